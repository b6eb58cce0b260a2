"""A small real policy-gradient step for the reference trainer (needs the hf extra).

GRPO-style: each sample's advantage is its score minus its group's mean score;
the loss is -mean(advantage x sum of the response tokens' log-probabilities under
the current model). After the step the weights go to a safetensors directory that
the hf engines load when the trainer publishes the new model step with its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consumer.batches import TrainBatch


class PolicyGradient:
    def __init__(self, model_dir: str, out_dir: str, lr: float = 1e-5, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch: Any = torch
        self.device = torch.device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model: Any = model.to(self.device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.out_dir = Path(out_dir)

    def __call__(self, batch: TrainBatch) -> float:
        """One optimizer step on the batch; returns the loss."""
        torch = self.torch
        terms = []
        for group in batch.groups:
            scores = [s.score or 0.0 for s in group.samples]
            baseline = sum(scores) / len(scores)
            for sample, score in zip(group.samples, scores, strict=True):
                if len(sample.response_ids) == 0 or score == baseline:
                    continue  # no signal: the advantage is zero
                ids = torch.tensor(
                    [sample.prompt_ids.tolist() + sample.response_ids.tolist()], device=self.device
                )
                logits = self.model(ids).logits[0, :-1].float()
                logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
                response = logprobs[len(sample.prompt_ids) - 1 :]
                terms.append(-(score - baseline) * response.sum())
        if not terms:
            return 0.0
        loss = torch.stack(terms).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def save(self, step: int) -> str:
        """The weights of ``step`` as a safetensors directory; returns its path."""
        path = self.out_dir / f"step-{step}"
        self.model.save_pretrained(path, safe_serialization=True)
        return str(path)
