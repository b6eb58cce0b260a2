"""What a learning run trains on: the model, the prompts, the judge and the few numbers
that go with them. The recipes of rollstream.recipes.learning (how to train: sync or
async, which correction) run any of these.

- ``REVERSE``: the reverse task's 14k-parameter model, made on the spot (recipes/reverse.py).
- ``ARITHMETIC``: SmolLM2-135M-Instruct (`smollm2-135m`, shared/models.py) on the times
  tables to 20 (recipes/arithmetic.py), greedy held-out accuracy 34 % before training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollstream.consumer.losses import AlgorithmConfig
from rollstream.recipes import arithmetic, reverse
from rollstream.shared.records import Prompt


@dataclass(frozen=True, slots=True)
class LearningTask:
    name: str  # the task's stream
    judge: str
    max_tokens: int
    lr: float
    # the model a run starts from, made (or found) for a run in a directory of its own
    model: Callable[[Path, int], str]
    # (train, held-out) prompts of a seed
    prompts: Callable[[int], tuple[list[Prompt], list[Prompt]]]
    eval_prompts: int = 32
    # whether an eval also samples the held-out prompts n times as in training (mean@n of
    # the reward), beside the greedy pass that gives the accuracy: n times the engines' work
    sampled_eval: bool = True
    eval_timeout_s: float = 300.0  # how long an eval waits for its results
    # the producer's: groups in flight, and how long one may take (on the engines' CPUs, a
    # real model's group of 8 takes far longer than the reverse task's 14k-parameter one)
    max_inflight: int = 32
    group_timeout_s: float = 60.0
    # samples per forward and backward pass of the trainer's step (algorithm.micro_batch_size;
    # 0: the whole batch): what bounds a real model's step in memory, for the same update
    micro_batch_size: int = 0

    def algorithm(self, algorithm: AlgorithmConfig) -> AlgorithmConfig:
        """A recipe's algorithm for this task: with the task's micro-batch size unless the
        recipe sets one."""
        if algorithm.micro_batch_size or not self.micro_batch_size:
            return algorithm
        return algorithm.model_copy(update={"micro_batch_size": self.micro_batch_size})


def _reverse_model(directory: Path, seed: int) -> str:
    return str(reverse.save_model(directory, seed))


def _arithmetic_prompts(seed: int) -> tuple[list[Prompt], list[Prompt]]:
    return arithmetic.prompts(len(arithmetic.questions()), seed), arithmetic.questions("held_out")


REVERSE = LearningTask(
    reverse.TASK, "reverse", reverse.MAX_TOKENS, reverse.LR, _reverse_model, reverse.all_prompts
)
ARITHMETIC = LearningTask(
    arithmetic.TASK,
    arithmetic.JUDGE,
    arithmetic.MAX_TOKENS,
    arithmetic.LR,
    lambda directory, seed: arithmetic.MODEL,  # converted once into the model cache, not per run
    _arithmetic_prompts,
    eval_prompts=len(arithmetic.questions("held_out")),
    sampled_eval=False,  # 205 x 8 samples on two CPU engines: minutes per eval
    eval_timeout_s=1800.0,  # 205 greedy answers took over 300 s on a loaded 2-core machine
    max_inflight=16,  # two steps' groups: more only queue on the engines, past their timeout
    group_timeout_s=900.0,
    # a step of 64 samples peaked at 9.5 GB in one pass, 4.2 GB in micro-batches of 16, in
    # the same time (bench/micro_batch.py)
    micro_batch_size=16,
)
TASKS = {t.name: t for t in (REVERSE, ARITHMETIC)}
