"""Any PyTorch loop on rollstream: each step's groups from the producers, a GRPO step on
them, the commit, then the weights back to the engines (docs/integrations.md).

    ROLLSTREAM_RUN=exp1 python examples/torch_loop.py --model DIR --steps 100
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from rollstream.consumer import create_batch_stream, load_settings

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="a directory of the model the engines run")
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
stream = create_batch_stream(load_settings(), steps=args.steps)  # ROLLSTREAM_* variables, rollstream.toml

for batch in stream:  # a TrainBatch: this step's groups, the too-stale ones expired
    loss = torch.zeros(())
    for group in batch.groups:
        scores = torch.tensor([s.score or 0.0 for s in group.samples])
        advantages = (scores - scores.mean()) / (scores.std() + 1e-4)  # GRPO's, within the group
        for sample, advantage in zip(group.samples, advantages, strict=True):
            ids = torch.tensor([[*sample.prompt_ids, *sample.response_ids]])
            logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1]
            logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.response_ids)[:, None])
            loss = loss - advantage * logp.mean()
    optimizer.zero_grad()
    (loss / len(batch)).backward()
    optimizer.step()
    stream.commit()  # after the optimizer step: acked and deleted, the run's train_step moved
    stream.publish_weights(model)  # through the run's weight transport: the engines' next batch
    print(f"step {batch.train_step}: {len(batch)} groups, loss {loss.item() / len(batch):.4f}", flush=True)
stream.close()
