"""The records both sides agree on: Prompt, Sample, Group and their Status.

Token ids and logprobs are numpy arrays (int32 / float32): the codec moves
them as packed bytes and decodes them without copying, and a trainer turns
them into tensors without copying either (``torch.from_numpy``). Records
accept plain lists too and convert them once, on construction.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

IdArray: TypeAlias = npt.NDArray[np.int32]
FloatArray: TypeAlias = npt.NDArray[np.float32]
PromptText: TypeAlias = str | list[dict[str, Any]]

ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")
MaskArray: TypeAlias = npt.NDArray[np.uint8]

# Every step shares one bound, the version dtype's: a model step is stamped on each response
# token as an int32 version (ID_DTYPE), and a train step becomes the model step of the
# weights it produced. A step past it fits int64 but would overflow the first version array
# made from it, in a producer or trainer, long after it was read.
MAX_STEP = int(np.iinfo(ID_DTYPE).max)
ID_MIN, ID_MAX = int(np.iinfo(ID_DTYPE).min), int(np.iinfo(ID_DTYPE).max)


class Status(StrEnum):
    COMPLETED = "completed"  # finished and judged -> groups stream
    ABORTED = "aborted"  # interrupted by a weight sync or pause -> aborted pool
    EXPIRED = "expired"  # too stale to train on -> expired pool
    FILTERED = "filtered"  # completed but rejected by is_valid -> counted, dropped
    FAILED = "failed"  # engine or judge error after retries -> dead letters


# A group that is not all COMPLETED takes the first of these that any sample has.
STATUS_PRECEDENCE = (Status.FAILED, Status.ABORTED, Status.EXPIRED, Status.FILTERED)


def group_status(statuses: Iterable[Status]) -> Status:
    present = set(statuses)
    if not present or present == {Status.COMPLETED}:
        return Status.COMPLETED
    for status in STATUS_PRECEDENCE:
        if status in present:
            return status
    raise AssertionError(f"unreachable: {present}")  # pragma: no cover


def as_ids(values: npt.ArrayLike) -> IdArray:
    return _flat(values, ID_DTYPE)


def as_logprobs(values: npt.ArrayLike) -> FloatArray:
    return _flat(values, LOGPROB_DTYPE)


def _flat(values: npt.ArrayLike, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Token arrays are 1-D and contiguous, so that the codec sends their memory as it is;
    an array that already is one comes back as it is."""
    if (
        type(values) is np.ndarray
        and values.dtype == dtype
        and values.ndim == 1
        and values.flags.c_contiguous
    ):
        return values
    return np.ascontiguousarray(values, dtype=dtype).reshape(-1)


# Who speaks in a turn of an agent trajectory: the model, or what answers it (an
# environment's observation, a tool's result). Only model turns are trained on.
MODEL, ENV, TOOL = "model", "env", "tool"


@dataclass(slots=True)
class Turn:
    """One turn of an agent trajectory (producer/agents): the next ``length`` tokens of
    the sample's response, spoken by ``role``. A trajectory's turns cover its response
    tokens exactly, in order; ``length`` 0 is a turn the model never saw (an environment
    that failed as the trajectory ended)."""

    role: str  # MODEL, ENV or TOOL (a plug-in agent may name others: not the model's)
    length: int
    text: str = ""  # the turn's text: the engine's for a model turn, as tokenised for others
    reward: float | None = None  # a model turn: what the environment gave for its action
    status: str | None = None  # a tool turn: ok, malformed, unknown_tool, timeout, error
    name: str | None = None  # a tool turn: the tool called


@dataclass(slots=True)
class Prompt:
    uid: str
    task: str
    prompt: PromptText
    prompt_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def group_id(self) -> str:
        """The id every attempt at this prompt's group carries."""
        return f"{self.task}:{self.uid}"


class Sample:
    """One response. ``response_versions[i]`` is the model step that produced token i.

    Token fields accept lists or arrays and are held as int32 / float32 arrays.

    An agent trajectory (producer/agents) is one sample too: its response is every
    token after the prompt, the model's turns and what answered them, in order.
    ``loss_mask`` (uint8, one per response token) is 1 on the tokens the model
    sampled, ``turns`` says which span is whose, ``agent_status`` how the trajectory
    ended; all three are None for a plain response (every token the model's).
    """

    __slots__ = (
        "agent_status", "finish_reason", "logprobs", "loss_mask", "prompt_ids", "response_ids",
        "response_versions", "reward", "status", "text", "turns",
    )  # fmt: skip

    def __init__(
        self,
        prompt_ids: npt.ArrayLike,
        response_ids: npt.ArrayLike,
        logprobs: npt.ArrayLike,
        response_versions: npt.ArrayLike,
        finish_reason: str | None = None,
        reward: dict[str, Any] | None = None,
        status: Status | str = Status.COMPLETED,
        text: str = "",
        *,
        loss_mask: npt.ArrayLike | None = None,
        turns: list[Turn] | None = None,
        agent_status: str | None = None,
    ) -> None:
        self.prompt_ids: IdArray = as_ids(prompt_ids)
        self.response_ids: IdArray = as_ids(response_ids)
        self.logprobs: FloatArray = as_logprobs(logprobs)
        self.response_versions: IdArray = as_ids(response_versions)
        self.finish_reason = finish_reason
        self.reward: dict[str, Any] = {} if reward is None else reward
        self.status = Status(status)
        self.text = text
        self.loss_mask: MaskArray | None = None if loss_mask is None else _flat(loss_mask, MASK_DTYPE)
        self.turns = turns
        self.agent_status = agent_status
        n = len(self.response_ids)
        if len(self.response_versions) != n:
            raise ValueError(f"response_versions has {len(self.response_versions)} entries for {n} tokens")
        if len(self.logprobs) not in (0, n):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {n} tokens")
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} tokens")
        covered = n if turns is None else sum(t.length for t in turns)
        if covered != n:
            raise ValueError(f"turns cover {covered} tokens, not the {n} of the response")

    @classmethod
    def of_arrays(
        cls,
        prompt_ids: IdArray,
        response_ids: IdArray,
        logprobs: FloatArray,
        response_versions: IdArray,
        *,
        finish_reason: str | None,
        reward: dict[str, Any],
        status: Status,
        text: str,
        loss_mask: MaskArray | None = None,
        turns: list[Turn] | None = None,
        agent_status: str | None = None,
    ) -> Sample:
        """A sample from arrays already of the right dtype and checked lengths (the
        codec's decoder): no conversion, no check."""
        sample = cls.__new__(cls)
        sample.prompt_ids, sample.response_ids = prompt_ids, response_ids
        sample.logprobs, sample.response_versions = logprobs, response_versions
        sample.finish_reason, sample.reward, sample.status, sample.text = finish_reason, reward, status, text
        sample.loss_mask, sample.turns, sample.agent_status = loss_mask, turns, agent_status
        return sample

    def __repr__(self) -> str:
        return (
            f"Sample(tokens={len(self.response_ids)}, prompt_tokens={len(self.prompt_ids)}, "
            f"finish_reason={self.finish_reason!r}, status={self.status.value}, reward={self.reward!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return (
            np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.response_ids, other.response_ids)
            # bit-for-bit, so that NaN logprobs compare equal to themselves
            and self.logprobs.tobytes() == other.logprobs.tobytes()
            and np.array_equal(self.response_versions, other.response_versions)
            and (self.finish_reason, self.reward, self.status, self.text, self.turns, self.agent_status)
            == (other.finish_reason, other.reward, other.status, other.text, other.turns, other.agent_status)
            and (
                self.loss_mask is other.loss_mask
                or (
                    self.loss_mask is not None
                    and other.loss_mask is not None
                    and np.array_equal(self.loss_mask, other.loss_mask)
                )
            )
        )

    __hash__ = None  # type: ignore[assignment]  # mutable record

    @property
    def score(self) -> float | None:
        score = self.reward.get("score")
        return None if score is None else float(score)


@dataclass(slots=True)
class Group:
    """The n responses to one prompt, as one unit of the replay buffer.

    ``model_step`` is the oldest policy version in the group: the minimum of
    all response token versions. Left at -1 it is derived from them (and stays
    -1 while the group has no response token); a value given is kept, which is
    how a decoded group skips the derivation. A producer gives ``for_prompt`` the
    step its requests started at, which a group without any response token (every
    response empty) takes: with -1 it would count as too stale at every train step
    past the threshold and be re-rolled for ever.
    """

    group_id: str
    task: str
    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)
    model_step: int = -1
    status: Status | None = None
    attempt: int = 1
    producer: str = ""
    created_at: float = field(default_factory=time.time)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_step < 0:
            steps = [int(s.response_versions.min()) for s in self.samples if len(s.response_versions)]
            self.model_step = min(steps, default=-1)
        self.status = (
            group_status(s.status for s in self.samples) if self.status is None else Status(self.status)
        )

    @classmethod
    def for_prompt(cls, prompt: Prompt, *, start_step: int | None = None, **kwargs: Any) -> Group:
        """The group of ``prompt``; ``start_step``: the model step its generation started
        at, the group's model_step when no response has a token to take it from."""
        group = cls(group_id=prompt.group_id, task=prompt.task, prompt=prompt, **kwargs)
        if group.model_step < 0 and start_step is not None and start_step >= 0:
            group.model_step = start_step
        return group

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_ids) for s in self.samples)

    @property
    def reward_mean(self) -> float | None:
        scores = [s.score for s in self.samples if s.score is not None]
        return sum(scores) / len(scores) if scores else None
