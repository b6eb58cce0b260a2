"""rollstream for TRL's GRPOTrainer (``rollout_func``, TRL >= 1.16, < 1.17).

    rollout = create_trl_rollout(settings)            # consumer/assembly.py builds this
    trainer = GRPOTrainer(model, reward_funcs=rollstream_reward, args=GRPOConfig(...),
                          train_dataset=prompts, rollout_func=rollout,
                          callbacks=[rollout.callback()])
    trainer.train()

Each generation TRL asks for (its prompts, each repeated ``num_generations`` times) goes
to the producers as one coordinator batch (``submit_batch``) and comes back as one group
per prompt (``take_train_batch``): the producers' prompt ids, response ids and logprobs,
one sample per entry, with the judge's score (``rollstream_reward`` passes it to TRL as
its reward) and each group's staleness. The callback commits the batch once the optimizer
steps that use it are done (``commit_train_batch``: acked and deleted, the run's
train_step advanced), then sends the trainer's weights through the run's weight transport
and publishes them as the next model step, so that the engines generate the next batch
with the current policy.

A restart (TRL's ``resume_from_checkpoint``) finds what the process before it left in the
adapter's record (rs:{run}:adapter:{name}): the batch it had in flight is taken again
when TRL asks for the same prompts (a checkpoint every step: ``save_steps=1``), else
aborted, its groups counted as dropped; and the weights are published again unless the
engines already hold those of the step TRL resumes from. One training process: TRL's
prompts of one generation reach one rollout function.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import orjson

from rollstream.consumer.coordinator import ACTIVE, BatchCoordinator
from rollstream.consumer.weights import SyncTimeout, WeightPublisher, wait_for_producers
from rollstream.shared.errors import IntegrationError, UnsupportedVersion
from rollstream.shared.events import RunControl
from rollstream.shared.records import Group, Prompt

__all__ = [
    "TESTED_TRL",
    "RolloutPlan",
    "TrlRollout",
    "check_trl",
    "rollstream_reward",
]

log = logging.getLogger(__name__)

# The TRL releases the adapters were run against: [low, high) as (major, minor)
TESTED_TRL = ((1, 16), (1, 17))
TESTED_RANGE = "trl>=1.16,<1.17"
REWARD_KEY = "rollstream_reward"  # the extra field TRL hands the reward functions
STALENESS_KEY = "rollstream_staleness"
# Fields of the adapter's record (rs:{run}:adapter:{name})
BATCH, BATCHES, PUBLISHED_STEP, PUBLISHED_FOR = "batch", "batches", "published_step", "published_for"


def check_trl(version: str | None = None) -> str:
    """The installed TRL's version (or ``version``), checked against the range the adapters
    were tested with; UnsupportedVersion names both otherwise."""
    if version is None:
        try:
            version = metadata.version("trl")
        except metadata.PackageNotFoundError:
            raise UnsupportedVersion(
                f"TRL is not installed: pip install 'rollstream[trl]' ({TESTED_RANGE})"
            ) from None
    found = re.match(r"(\d+)\.(\d+)", version)
    low, high = TESTED_TRL
    if found is None or not low <= (int(found[1]), int(found[2])) < high:
        raise UnsupportedVersion(
            f"TRL {version} is installed; rollstream's TRL adapters are tested with {TESTED_RANGE}: "
            f"pip install 'rollstream[trl]' (or 'trl>={low[0]}.{low[1]},<{high[0]}.{high[1]}')"
        )
    return version


def rollstream_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: the score rollstream's judge gave each completion (NaN where
    it gave none: TRL leaves those out of the advantage)."""
    scores = kwargs.get(REWARD_KEY)
    if scores is None:
        raise IntegrationError(
            "rollstream_reward has no judged rewards to pass on: give GRPOTrainer rollstream's "
            "rollout_func (create_trl_rollout) along with it"
        )
    if len(scores) != len(completions):
        raise IntegrationError(f"{len(scores)} judged rewards for {len(completions)} completions")
    return [float("nan") if s is None else float(s) for s in scores]


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """The numbers a TrlRollout works by (consumer/assembly.py takes them from the settings)."""

    name: str  # the adapter's name: its record, and the coordinator's consumer name
    task: str  # where prompts go that the catalog does not name
    group_size: dict[str, int]  # tasks[].n of each task: TRL's num_generations must equal it
    batch_size: int  # rollout.batch_size: at least the prompts of one TRL generation
    stale_threshold: int  # rollout.stale_threshold: a group this stale is made again, not trained
    reroll: bool = True  # rollout.tail_batch_trigger_size 0: expired prompts are made again at once
    timeout_s: float | None = None  # the wait for a batch's groups; None: as long as it takes
    sync_timeout_s: float = 120.0  # the wait for producers to follow a weight sync (a warning after)


@dataclass(slots=True)
class _InFlight:
    batch_id: str
    train_step: int  # rollstream's train step the batch is for
    until: int  # TRL's global_step once the optimizer steps that use it are done


class TrlRollout:
    """TRL's ``rollout_func`` over a coordinator; ``callback()`` commits and publishes."""

    def __init__(
        self,
        coordinator: BatchCoordinator,
        control: RunControl,
        publisher: WeightPublisher,
        plan: RolloutPlan,
        catalog: Mapping[str, Prompt] | Sequence[Prompt] | None = None,
    ) -> None:
        check_trl()
        self.coordinator = coordinator
        self.control = control
        self.publisher = publisher
        self.plan = plan
        # prompt text (or chat messages as JSON) -> the rollstream prompt: its task and the
        # meta its judge needs (ground truth), which TRL does not hand a rollout function
        items = catalog.values() if isinstance(catalog, Mapping) else (catalog or ())
        self.catalog = {prompt_key(p.prompt): p for p in items}
        self.record = coordinator.keys.adapter(plan.name)
        self.client: Any = coordinator.client
        self.in_flight: _InFlight | None = None
        self.last_groups: list[Group] = []  # of the last batch handed to TRL (tests, logs)

    # --- TRL's side --------------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if not trainer.model.training:
            raise IntegrationError(
                "TRL asked rollstream for eval completions: evaluate with rollstream's coordinator "
                "eval batches (create_coordinator().submit_batch(..., kind='eval')), eval_strategy 'no' here"
            )
        if trainer.accelerator.num_processes > 1:
            raise IntegrationError("rollstream's rollout_func runs in one training process (num_processes 1)")
        n = int(trainer.num_generations)
        if self.in_flight is not None:
            raise IntegrationError(
                f"TRL asked for a generation while batch {self.in_flight.batch_id} is not committed: "
                "give GRPOTrainer the callback too (callbacks=[rollout.callback()])"
            )
        wanted = self.prompts_of(prompts, n)
        step = self.control.model_step() + 1
        batch_id = self._batch_for(wanted)
        groups = self._fresh(batch_id, step)
        args = trainer.args
        generate_every = int(args.steps_per_generation) * int(trainer.num_iterations)
        covers = max(1, math.ceil(generate_every / int(args.gradient_accumulation_steps)))
        self.in_flight = _InFlight(batch_id, step, int(trainer.state.global_step) + covers)
        self.last_groups = groups
        return completions(groups, batch_id, wanted, n, step)

    def _fresh(self, batch_id: str, step: int) -> list[Group]:
        """The batch's groups for train step ``step``, each within the staleness bound: one
        made on weights ``stale_threshold`` syncs old or more (by producers that had not
        followed the syncs yet, say) goes back to be made again, and the batch waits for it."""
        while True:
            groups = self.coordinator.take_train_batch(batch_id, self.plan.timeout_s)
            stale = {g.group_id for g in groups if step - g.model_step - 1 >= self.plan.stale_threshold}
            if not stale:
                return groups
            if not self.plan.reroll:
                raise IntegrationError(
                    f"batch {batch_id}: {len(stale)} groups are {self.plan.stale_threshold} or more weight "
                    "syncs stale, and rollout.tail_batch_trigger_size does not make expired prompts again "
                    "at once: set it to 0"
                )
            log.warning("rollstream: batch %s: %d groups too stale, made again", batch_id, len(stale))
            self.coordinator.expire_taken(batch_id, stale, step)

    def prompts_of(self, prompts: list[Any], n: int) -> list[Prompt]:
        """TRL's entries (each prompt ``n`` times in a row) as one rollstream prompt per block."""
        if not prompts or len(prompts) % n:
            raise IntegrationError(f"{len(prompts)} prompts from TRL: not blocks of num_generations {n}")
        out = []
        for i in range(0, len(prompts), n):
            key = prompt_key(prompts[i])
            if any(prompt_key(p) != key for p in prompts[i : i + n]):
                raise IntegrationError(
                    f"TRL's prompts {i}..{i + n - 1} are not one prompt repeated num_generations {n} times"
                )
            known = self.catalog.get(key)
            task = known.task if known else self.plan.task
            uid = f"{i // n}-{known.uid if known else hashlib.sha1(key.encode()).hexdigest()[:12]}"
            out.append(Prompt(uid, task, prompts[i], meta=dict(known.meta) if known else {}))
        for task in {p.task for p in out}:
            if self.plan.group_size.get(task) != n:
                size = self.plan.group_size.get(task)
                raise IntegrationError(
                    f"TRL's num_generations is {n} and task {task!r} has n = {size}: set tasks[].n to it"
                )
        if len(out) > self.plan.batch_size:
            raise IntegrationError(
                f"one TRL generation is {len(out)} prompts and rollout.batch_size {self.plan.batch_size}: "
                "producers would admit only that many groups a step; set rollout.batch_size to "
                "generation_batch_size / num_generations"
            )
        return out

    def _batch_for(self, prompts: list[Prompt]) -> str:
        """The batch of these prompts: the one in flight before a restart when it has them,
        else a new one (the other, if any, aborted: its groups counted as dropped)."""
        left = self.client.hget(self.record, BATCH)
        if left is not None:
            batch_id = str(left.decode())
            status = self.coordinator.status(batch_id)
            fed = status in ("running", "finalizing", "handed")
            if fed and self.coordinator.submitted_with(batch_id, prompts):
                log.info("rollstream: taking batch %s again, left %s by the process before", batch_id, status)
                return batch_id
            if status in ACTIVE:
                log.warning(
                    "rollstream: batch %s, left %s by the process before, was for other prompts than TRL "
                    "asks for now (a checkpoint older than its step): aborted, its groups dropped",
                    batch_id, status,
                )  # fmt: skip
                if status == "finalizing":  # its dead finalizer's lease runs out first
                    self.coordinator.take_train_batch(batch_id, self.plan.timeout_s)
                self.coordinator.abort_batch(batch_id, "the trainer resumed on other prompts")
        batch_id = f"{self.plan.name}-{int(self.client.hincrby(self.record, BATCHES, 1))}"
        self.client.hset(self.record, BATCH, batch_id)
        self.coordinator.submit_batch(batch_id, prompts)
        return batch_id

    # --- after the optimizer step ------------------------------------------------------

    def begin(self, model: Any, global_step: int) -> None:
        """On train begin: the engines get the trainer's weights unless they hold those of
        ``global_step`` already (published by the process before, which TRL resumes)."""
        held = self.client.hmget(self.record, [PUBLISHED_STEP, PUBLISHED_FOR])
        current = self.control.model_step()
        if held[0] is not None and int(held[0]) == current and int(held[1]) == global_step:
            log.info("rollstream: the engines hold the weights of step %d already", global_step)
            return
        self.publish(model, global_step)

    def step_end(self, model: Any, global_step: int) -> None:
        """After each optimizer step: commit the batch whose steps are done, then publish."""
        batch = self.in_flight
        if batch is not None and global_step >= batch.until:
            self.coordinator.commit_train_batch(batch.batch_id, batch.train_step)
            self.control.advance_train_step(batch.train_step)
            self.client.hdel(self.record, BATCH)
            self.in_flight = None
        self.publish(model, global_step)

    def publish(self, model: Any, global_step: int) -> int:
        step, _ = self.publisher.publish(model)
        self.client.hset(self.record, mapping={PUBLISHED_STEP: step, PUBLISHED_FOR: global_step})
        try:
            wait_for_producers(self.control, step, self.plan.sync_timeout_s)
        except (
            SyncTimeout
        ) as exc:  # the next batch may then be generated a step behind: its staleness says so
            log.warning("rollstream: %s", exc)
        return step

    def callback(self) -> Any:
        """The TrainerCallback that GRPOTrainer needs beside this rollout function."""
        from transformers import TrainerCallback

        rollout = self

        class RollstreamCallback(TrainerCallback):
            """Weights to rollstream's engines at train begin and after each optimizer
            step, and the batch committed once its steps are done."""

            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                rollout.begin(kwargs["model"], int(state.global_step))

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                rollout.step_end(kwargs["model"], int(state.global_step))

        return RollstreamCallback()


def prompt_key(prompt: Any) -> str:
    """A prompt as one string: its text, or its chat messages as JSON."""
    return prompt if isinstance(prompt, str) else orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS).decode()


def completions(
    groups: list[Group], batch_id: str, prompts: list[Prompt], n: int, step: int
) -> dict[str, list[Any]]:
    """What TRL's rollout_func returns: one completion per entry (the k-th entry of a
    prompt's block gets its group's k-th sample), the judged scores and each group's
    staleness at ``step`` as extra fields (TRL hands them to the reward functions), and
    ``env_mask`` where an agent's samples carry a loss mask."""
    by_uid = {g.prompt.uid.removeprefix(f"{batch_id}/"): g for g in groups}
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], REWARD_KEY: []}
    out[STALENESS_KEY] = []
    masks: list[list[int]] = []
    for prompt in prompts:
        group = by_uid.get(prompt.uid)
        if group is None:
            raise IntegrationError(f"batch {batch_id}: no group for prompt {prompt.uid}")
        if len(group.samples) < n:
            raise IntegrationError(f"group {group.group_id} has {len(group.samples)} samples for {n} entries")
        for sample in group.samples[:n]:
            if not len(sample.response_ids):
                raise IntegrationError(f"group {group.group_id} has an empty response: TRL needs a token")
            out["prompt_ids"].append(sample.prompt_ids.tolist())
            out["completion_ids"].append(sample.response_ids.tolist())
            out["logprobs"].append(sample.logprobs.tolist())
            out[REWARD_KEY].append(sample.score)
            out[STALENESS_KEY].append(step - group.model_step - 1)
            mask = sample.loss_mask
            masks.append([1] * len(sample.response_ids) if mask is None else mask.tolist())
    if any(0 in m for m in masks):
        out["env_mask"] = masks  # TRL's mask of the model's own tokens
    return out
