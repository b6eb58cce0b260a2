"""Group entries written: the plain fields redis-cli shows, ``meta`` as orjson, the token
arrays as the bytes they hold (shared/codec.py draws the entry); and the record of a
group the producer's filter dropped."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from rollstream.shared.prompt_entries import prompt_to_dict
from rollstream.shared.records import ID_DTYPE, Group, IdArray, Sample, Status, Turn
from rollstream.shared.summary import sample_scores, summary_line
from rollstream.shared.wire import FORMAT_VERSION, TRAJECTORY_FORMAT_VERSION, Fields, WireFields

_EMPTY_IDS = np.zeros(0, dtype=ID_DTYPE)


def encode_filtered(group: Group, source: str, source_id: str) -> Fields:
    """The record of a group the producer's filter dropped, for ``rs:{run}:filtered``: no
    samples, only what names the prompt and why it was dropped, so that every prompt's
    outcome can be found by its uid (a trained one by the trainer's record, a dead one in
    the dead letters, an expired one in its pool)."""
    reward_mean = group.reward_mean
    return {
        "format": FORMAT_VERSION,
        "task": group.task,
        "uid": group.prompt.uid,
        "group_id": group.group_id,
        "producer": group.producer,
        "attempt": group.attempt,
        "n": len(group.samples),
        "reward_mean": "" if reward_mean is None else repr(reward_mean),
        "source": source,
        "source_id": source_id,
    }


def _runs(arrays: list[IdArray]) -> list[list[list[int]]]:
    """Each sample's versions as [step, count] runs, from one scan of the whole group
    (a few array operations per group rather than per sample)."""
    lengths = [len(a) for a in arrays]
    if not any(lengths):
        return [[] for _ in arrays]
    versions = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    changes = (np.flatnonzero(versions[1:] != versions[:-1]) + 1).tolist()
    out, j, start = [], 0, 0
    for n in lengths:
        end = start + n
        runs: list[list[int]] = []
        if n:
            while j < len(changes) and changes[j] <= start:
                j += 1
            a = start
            while j < len(changes) and changes[j] < end:
                runs.append([int(versions[a]), changes[j] - a])
                a = changes[j]
                j += 1
            runs.append([int(versions[a]), end - a])
        out.append(runs)
        start = end
    return out


def encode_group(group: Group, *, summary: bool = False) -> Fields:
    """A group's stream-entry fields, every value as Redis stores it."""
    return {
        name: b"".join(array.data for array in value) if isinstance(value, tuple) else value
        for name, value in encode_group_parts(group, summary=summary).items()
    }


def encode_group_parts(group: Group, *, summary: bool = False) -> WireFields:
    """``encode_group`` with each token field left as the tuple of its samples' arrays,
    for a writer that copies them into its buffer once (shared/resp.py)."""
    samples = group.samples
    first = samples[0].prompt_ids if samples else _EMPTY_IDS
    shared_prompt = all(s.prompt_ids is first or np.array_equal(s.prompt_ids, first) for s in samples[1:])
    sample_meta = []
    trajectories = False
    for s, runs in zip(samples, _runs([s.response_versions for s in samples]), strict=True):
        item: dict[str, Any] = {
            "len": len(s.response_ids),
            "lp": len(s.logprobs),
            "ver": runs,
            "finish": s.finish_reason,
            "reward": s.reward,
            "status": s.status.value,
            "text": s.text,
        }
        if not shared_prompt:
            item["plen"] = len(s.prompt_ids)
        if s.loss_mask is not None or s.turns is not None or s.agent_status is not None:
            _trajectory_meta(s, item)
            trajectories = True
        sample_meta.append(item)
    prompt = prompt_to_dict(group.prompt)
    # The prompt's own token ids are nearly always its samples' prompt ids: store them once.
    in_samples = bool(
        shared_prompt
        and samples
        and group.prompt.prompt_ids is not None
        and samples[0].prompt_ids.tolist() == group.prompt.prompt_ids
    )
    if in_samples:
        del prompt["prompt_ids"]
    meta = {
        "prompt": prompt,
        "prompt_ids_in_samples": in_samples,
        "samples": sample_meta,
        "shared_prompt": shared_prompt,
        "created_at": group.created_at,
        "timings": group.timings,
    }
    # Group.reward_mean and .response_tokens, from what the summary uses too
    scores = sample_scores(samples)
    reward_mean = sum(scores) / len(scores) if scores else None
    lengths = [item["len"] for item in sample_meta]
    status = group.status or Status.COMPLETED
    prompt_parts = (first,) if shared_prompt else tuple(s.prompt_ids for s in samples)
    fields: WireFields = {
        "summary": "",  # first, where redis-cli shows it at the top of the entry
        "format": TRAJECTORY_FORMAT_VERSION if trajectories else FORMAT_VERSION,
        "task": group.task,
        "group_id": group.group_id,
        "model_step": group.model_step,
        "status": status.value,
        "n": len(samples),
        "attempt": group.attempt,
        "producer": group.producer,
        "reward_mean": "" if reward_mean is None else repr(reward_mean),
        "prompt_tokens": sum(len(p) for p in prompt_parts),
        "response_tokens": sum(lengths),
        "meta": orjson.dumps(meta),
        # Samples hold little-endian int32 / float32 arrays (records.as_ids): bytes as they are.
        "prompt_ids": prompt_parts,
        "response_ids": tuple(s.response_ids for s in samples),
        "logprobs": tuple(s.logprobs for s in samples),
    }
    if summary:
        fields["summary"] = summary_line(group, status, lengths, scores, reward_mean)
    else:
        del fields["summary"]
    return fields


def _trajectory_meta(sample: Sample, item: dict[str, Any]) -> None:
    """An agent trajectory's keys of its sample object (format 1.1): the loss mask as
    [value, count] runs like the versions, the turns, the agent's status."""
    if sample.loss_mask is not None:
        item["mask"] = _value_runs(sample.loss_mask)
    if sample.turns is not None:
        item["turns"] = [turn_to_dict(t) for t in sample.turns]
    if sample.agent_status is not None:
        item["agent"] = sample.agent_status


def _value_runs(values: npt.NDArray[Any]) -> list[list[int]]:
    if not len(values):
        return []
    starts = [0, *(np.flatnonzero(values[1:] != values[:-1]) + 1).tolist(), len(values)]
    return [[int(values[a]), b - a] for a, b in itertools.pairwise(starts)]


def turn_to_dict(turn: Turn) -> dict[str, Any]:
    out: dict[str, Any] = {"role": turn.role, "len": turn.length}
    if turn.text:
        out["text"] = turn.text
    if turn.reward is not None:
        out["reward"] = turn.reward
    if turn.status is not None:
        out["status"] = turn.status
    if turn.name is not None:
        out["name"] = turn.name
    return out
