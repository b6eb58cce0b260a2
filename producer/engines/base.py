"""The engine protocol: what every inference engine implements, and the records it
speaks in. One file per engine beside this one (sim, hf; vllm and http later).

An engine generates the n responses of one prompt together (they share the
prompt's prefix cache), can abort what is in flight — each aborted request
comes back from ``generate`` with finish_reason "abort" and the tokens it had
so far — pause (keeping its KV cache) and resume, and load new weights. Every
response token carries the model step the engine held when it made it, so a
weight update in the middle of a request shows in ``versions``.

Across a process boundary (a Ray actor call) these records travel as orjson
bytes through ``dumps`` / ``loads``: no pickle of ours on that path.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import orjson
from pydantic import BaseModel

from rollstream.shared import models
from rollstream.shared.errors import RollstreamError
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE, FloatArray, IdArray

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


class EngineError(RollstreamError):
    """An engine could not serve a request (crashed, failed, or was killed)."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings (engines with a tokenizer)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, tests)
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        return cls(**data)


@dataclass(slots=True, eq=False)
class Generation:
    """One response as an engine returns it."""

    response_ids: IdArray
    logprobs: FloatArray
    versions: IdArray  # the model step of each response token
    finish_reason: str
    text: str = ""
    error: str = ""  # why, when finish_reason is "error"

    def __post_init__(self) -> None:
        self.response_ids = np.asarray(self.response_ids, dtype=ID_DTYPE)
        self.logprobs = np.asarray(self.logprobs, dtype=LOGPROB_DTYPE)
        self.versions = np.asarray(self.versions, dtype=ID_DTYPE)

    def to_dict(self) -> dict[str, Any]:
        return {
            "response_ids": self.response_ids.tobytes(),
            "logprobs": self.logprobs.tobytes(),
            "versions": self.versions.tobytes(),
            "finish_reason": self.finish_reason,
            "text": self.text,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Generation:
        return cls(
            response_ids=np.frombuffer(data["response_ids"], dtype=ID_DTYPE),
            logprobs=np.frombuffer(data["logprobs"], dtype=LOGPROB_DTYPE),
            versions=np.frombuffer(data["versions"], dtype=ID_DTYPE),
            finish_reason=data["finish_reason"],
            text=data.get("text", ""),
            error=data.get("error", ""),
        )


@dataclass(slots=True)
class EngineHealth:
    healthy: bool
    model_step: int
    paused: bool
    outstanding: int  # requests accepted and not yet returned (running + queued)
    running: int
    queued: int
    busy_fraction: float  # decode tokens/s in use over capacity, averaged since the last call
    detail: str = ""
    busy_total: float = 0.0  # the same, averaged since the engine started (whoever else asks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Engine(Protocol):
    """What every engine implements. Methods are coroutines: an engine serves many
    requests at once (continuous batching) from one event loop."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        """n responses to one prompt. An aborted request returns what it had, with
        finish_reason "abort"; a failed one raises EngineError."""
        ...

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Abort the given in-flight requests (all when None); returns how many."""
        ...

    async def pause(self) -> None:
        """Stop decoding, keeping in-flight requests and their KV cache."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        """Load the weights of ``model_step`` (from a directory of safetensors, when the
        engine loads real weights); later tokens carry the new step."""
        ...

    async def health(self) -> EngineHealth: ...


def dumps(value: Any) -> bytes:
    """orjson, with bytes (packed token arrays) as base64."""
    return orjson.dumps(value, default=_default)


def _default(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__b64__": base64.b64encode(value).decode("ascii")}
    raise TypeError(f"not serializable: {type(value).__name__}")


def loads(data: bytes) -> Any:
    return _restore(orjson.loads(data))


def _restore(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and "__b64__" in value:
            return base64.b64decode(value["__b64__"])
        return {k: _restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return value


ModelSettings = TypeVar("ModelSettings", bound=BaseModel)


def local_model(settings: ModelSettings, kind: str) -> tuple[ModelSettings, Path]:
    """An engine's settings with ``model`` the directory to load, and that directory: a
    known model by name (smollm2-135m) is its cached conversion (shared/models.py)."""
    name = str(getattr(settings, "model", ""))
    try:
        path = Path(models.resolve(name))
    except models.ModelError as exc:
        raise EngineError(f"{kind} engine: {exc}") from exc
    if name and str(path) != name:
        settings = settings.model_copy(update={"model": str(path)})
    return settings, path
