"""The reverse task: a model that learns, through rollstream, to write three symbols
back to front. ``"c a m >"`` → ``"m a c <eos>"``.

Everything is generated at run time from a seed, with no hub download and no weights
in the repository (needs the hf extra: torch, transformers, tokenizers):

- a 16-token vocabulary: the 13 symbols ``a`` … ``m``, ``>``, ``<eos>`` and ``<pad>``,
  as a word-level ``tokenizers`` model saved as a ``PreTrainedTokenizerFast`` (what
  ``AutoTokenizer`` loads in the engines and producers);
- a random-initialised decoder-only model: a GPT-2 of 13,792 parameters (hidden size
  32, one layer, four heads, 16 positions, tied embeddings), what the hf engine and
  ``consumer.pg.PolicyGradient`` load with ``AutoModelForCausalLM``;
- every prompt of the task (13^3 = 2,197), shuffled by the seed, of which
  ``EVAL_PROMPTS`` are held out for evaluation and the rest are for training;
- the judge is ``producer/judges/reverse.py`` (built-in name ``"reverse"``): a partial
  reward per position (the three symbols, then the end), so a random policy scores
  about 1/16 = 0.06.

``train_in_process`` trains the same model on the same task with the same algorithm
code (consumer.advantages, consumer.losses through PolicyGradient) in a plain loop
without Redis, Ray or engines: the reference that the runs through rollstream are
compared with.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.losses import AlgorithmConfig
from rollstream.producer.engines.base import FINISH_LENGTH, FINISH_STOP
from rollstream.producer.judges.base import apply_rewards
from rollstream.producer.judges.reverse import ReverseJudge
from rollstream.recipes import prompts as prompt_files
from rollstream.shared.records import Group, Prompt, Sample

log = logging.getLogger(__name__)

TASK = "reverse"
SYMBOLS = tuple("abcdefghijklm")
ARROW, EOS, PAD = ">", "<eos>", "<pad>"
VOCAB = (PAD, EOS, ARROW, *SYMBOLS)  # ids 0, 1, 2, then the symbols
LENGTH = 3  # symbols per prompt
MAX_TOKENS = LENGTH + 1  # the reversed symbols and <eos>
EVAL_PROMPTS = 64
CHANCE = 1 / len(VOCAB)  # each position right by chance under a uniform policy
MODEL_SIZE: dict[str, int] = {"hidden": 32, "layers": 1, "heads": 4}
CONTEXT = 16  # positions: the prompt's 4 tokens and the response's 4, with room to spare
INIT_RANGE = 0.05

# The reference recipe: GRPO with (r - mean) / (std + 1e-4), one update a batch
ALGORITHM = AlgorithmConfig(advantage="grpo", adv_eps=1e-4)
LR = 1e-3


def make_tokenizer() -> Any:
    """The task's tokenizer: one token per white-space separated word of ``VOCAB``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, eos_token=EOS, pad_token=PAD
    )
    return tokenizer


def make_model(seed: int = 0, init: float = INIT_RANGE, **size: int) -> Any:
    """A random-initialised GPT-2 for the task's vocabulary; ``seed`` picks its weights.

    GPT-2, not Llama: its learned absolute positions let one layer's queries know where
    they are, which reversal needs (a query at the middle output position must look 3
    tokens back, one at the last 5); with rotary positions only, a one-layer query
    cannot tell those positions apart and the middle symbol stays at chance. Dropout
    is off (sampling and training see the same function), and the initial weights are
    wider than GPT-2's 0.02 (``init``): attention that starts a little peaked finds the
    positions sooner (0.9 mean reward in ~400 steps instead of ~700)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = {**MODEL_SIZE, **size}
    config = GPT2Config(
        vocab_size=len(VOCAB),
        n_embd=shape["hidden"],
        n_layer=shape["layers"],
        n_head=shape["heads"],
        n_positions=CONTEXT,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=VOCAB.index(EOS),
        pad_token_id=VOCAB.index(PAD),
    )
    torch.manual_seed(seed)
    model: Any = GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]
    return model.eval()


def parameter_count(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters())


def save_model(directory: str | Path, seed: int = 0, init: float = INIT_RANGE) -> Path:
    """The model and tokenizer of ``seed`` in ``directory``, as from_pretrained reads them."""
    path = Path(directory)
    make_model(seed, init).save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def all_prompts(seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """Every prompt of the task, shuffled by ``seed``: (train, held-out eval)."""
    rows = [
        Prompt(uid=f"{a}{b}{c}", task=TASK, prompt=f"{a} {b} {c} {ARROW}", meta={"answer": f"{c} {b} {a}"})
        for a in SYMBOLS
        for b in SYMBOLS
        for c in SYMBOLS
    ]
    random.Random(seed).shuffle(rows)
    return rows[EVAL_PROMPTS:], rows[:EVAL_PROMPTS]


def write_prompt_files(directory: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl of the task in ``directory`` (recipes/prompts.py)."""
    return prompt_files.write_prompt_files(directory, *all_prompts(seed))


# --- the reference: the same learning in one plain loop ------------------------------


@dataclass(slots=True)
class InProcessRun:
    rewards: list[float] = field(default_factory=list)  # mean reward of each step's batch

    def steps_to(self, target: float, window: int = 10) -> int | None:
        """The first step at which the mean reward of the last ``window`` steps reaches
        ``target`` (None if it never does)."""
        return steps_to(self.rewards, target, window)


def steps_to(rewards: list[float], target: float, window: int = 10) -> int | None:
    """The first step (1-based) whose trailing ``window``-step mean reward reaches ``target``."""
    for i in range(len(rewards)):
        recent = rewards[max(0, i + 1 - window) : i + 1]
        if len(recent) == min(window, len(rewards)) and sum(recent) / len(recent) >= target:
            return i + 1
    return None


def sample_groups(model: Any, prompts: list[Prompt], n: int, generator: Any, step: int) -> list[Group]:
    """n samples of each prompt from ``model`` at temperature 1, decoded in one batch, with
    the logprobs and versions an engine records, judged by the task's judge."""
    import torch

    tokenizer = _tokenizer()
    eos = VOCAB.index(EOS)
    prompt_ids = [tokenizer.encode(p.prompt) for p in prompts]
    ids = torch.tensor([p for p in prompt_ids for _ in range(n)], dtype=torch.long)
    width = ids.shape[1]
    logprobs = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = torch.multinomial(logp.exp(), 1, generator=generator)
            logprobs.append(logp.gather(1, chosen))
            ids = torch.cat([ids, chosen], dim=1)
    tokens, lps = ids[:, width:].tolist(), torch.cat(logprobs, dim=1).tolist()
    judge, groups = ReverseJudge(), []
    for g, prompt in enumerate(prompts):
        samples = []
        for row in range(g * n, (g + 1) * n):
            out = tokens[row]
            end = out.index(eos) + 1 if eos in out else len(out)
            samples.append(
                Sample(
                    prompt_ids[g], out[:end], lps[row][:end], [step] * end,
                    finish_reason=FINISH_STOP if eos in out else FINISH_LENGTH,
                    text=tokenizer.decode(out[:end], skip_special_tokens=True),
                )
            )  # fmt: skip
        group = Group.for_prompt(prompt, samples=samples)
        apply_rewards(group.samples, judge(prompt, group.samples))
        groups.append(group)
    return groups


def train_in_process(
    model_dir: str | Path,
    steps: int,
    *,
    prompts_per_step: int = 8,
    n: int = 8,
    lr: float = LR,
    seed: int = 0,
    algorithm: AlgorithmConfig = ALGORITHM,
    stop_at: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> InProcessRun:
    """GRPO on the task's training prompts with PolicyGradient, sampling from the model
    it trains (on-policy): ``steps`` steps of ``prompts_per_step`` × ``n`` samples, or
    fewer once the trailing mean reward reaches ``stop_at``."""
    import tempfile

    import torch

    from rollstream.consumer.pg import PolicyGradient

    train, _ = all_prompts(seed)
    order = random.Random(seed + 1)
    generator = torch.Generator().manual_seed(seed)
    run = InProcessRun()
    with tempfile.TemporaryDirectory() as out:
        policy = PolicyGradient(str(model_dir), out, lr=lr, algorithm=algorithm)
        for step in range(1, steps + 1):
            prompts = order.sample(train, prompts_per_step)
            groups = sample_groups(policy.model, prompts, n, generator, step - 1)
            policy(TrainBatch.of_groups(step, groups))
            reward = sum(s.score or 0.0 for g in groups for s in g.samples) / (len(groups) * n)
            run.rewards.append(reward)
            if on_step is not None:
                on_step(step, reward)
            if stop_at is not None and run.steps_to(stop_at) is not None:
                break
    return run


_TOKENIZER: list[Any] = []


def _tokenizer() -> Any:
    if not _TOKENIZER:
        _TOKENIZER.append(make_tokenizer())
    return _TOKENIZER[0]
