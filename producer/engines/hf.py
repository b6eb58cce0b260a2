"""The Hugging Face engine: transformers on one device, CPU or GPU, for small real runs
and tests. No continuous batching: the n samples of a request decode as one batch,
and concurrent requests take turns, one decode step at a time.

The decode loop is our own rather than ``model.generate`` so that every step is a
point where the engine can stop (abort), wait (pause) or take new weights, and so
that each token carries its logprob and the model step that produced it.

Logprobs are of the model's raw distribution, log_softmax of the untempered
logits, whatever temperature and top_p did to the sampling: that is what the
trainer recomputes. A stop string ends a sample at the token that completes it:
the response ids and text both keep the stop string (the text is cut right after
it), as EOS and stop_token_ids are kept, so text and ids agree.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    EngineHealth,
    Generation,
    SamplingParams,
)
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE
from rollstream.shared.settings import EngineSettings, HFEngineSettings

_T = TypeVar("_T")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class HFEngine:
    def __init__(self, settings: HFEngineSettings, model_step: int = 0) -> None:
        self.settings = settings
        self.model_step = model_step
        self.paused = False
        path = Path(settings.model)
        if not settings.model or not (path / "config.json").is_file():
            raise EngineError(f"hf engine: no model directory (config.json) at {str(path)!r}")
        try:
            self.device = torch.device(settings.device)
            self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
            model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[settings.dtype])
            self.model: Any = model.to(self.device).eval()
        except (OSError, ValueError, RuntimeError) as exc:
            raise EngineError(f"hf engine: cannot load the model at {str(path)!r}: {exc}") from exc
        eos = [self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id]
        self._eos: set[int] = set()
        for value in eos:  # generation_config may name several (chat models end turns their own way)
            self._eos.update(value if isinstance(value, list) else [] if value is None else [value])
        self._context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self._requests: dict[str, _Request] = {}
        self._resumed = asyncio.Event()
        self._resumed.set()
        # One forward pass or weight load at a time: updates land between decode steps
        self._lock = asyncio.Lock()
        self._started = time.monotonic()
        self._busy_s = 0.0  # in forward passes, since the start: health's busy_total

    def encode_prompt(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """Token ids of a plain prompt, or of chat messages through the tokenizer's template."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        # Render, then encode without special tokens: the template writes its own BOS
        text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # --- the protocol ----------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        request = _Request(request_id or uuid.uuid4().hex)
        if request.request_id in self._requests:
            raise EngineError(f"hf engine: request {request.request_id!r} is already in flight")
        if not prompt_ids:
            raise EngineError("hf engine: empty prompt")
        max_tokens = params.max_tokens
        if self._context:
            max_tokens = min(max_tokens, self._context - len(prompt_ids))
            if max_tokens <= 0 < params.max_tokens:
                raise EngineError(f"hf engine: a prompt of {len(prompt_ids)} tokens fills the context")
        self._requests[request.request_id] = request
        try:
            return await self._decode(request, prompt_ids, params, n, max(max_tokens, 0))
        except (RuntimeError, ValueError) as exc:  # torch's errors (out of memory, device lost)
            raise EngineError(f"hf engine: request {request.request_id!r} failed: {exc}") from exc
        finally:
            del self._requests[request.request_id]

    async def abort(self, request_ids: list[str] | None = None) -> int:
        ids = list(self._requests) if request_ids is None else [r for r in request_ids if r in self._requests]
        for request_id in ids:
            self._requests[request_id].aborted.set()
        return len(ids)

    async def pause(self) -> None:
        self.paused = True
        self._resumed.clear()
        async with self._lock:  # returns once the step in flight (if any) is done
            pass

    async def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        async with self._lock:
            if path is not None:
                await _in_thread(self._load_weights, Path(path))
            self.model_step = model_step

    async def health(self) -> EngineHealth:
        running = 0 if self.paused else len(self._requests)
        return EngineHealth(
            healthy=True,
            model_step=self.model_step,
            paused=self.paused,
            outstanding=len(self._requests),
            running=running,
            queued=0,
            busy_fraction=1.0 if running else 0.0,
            detail=f"hf {self.settings.model} on {self.device}",
            busy_total=min(1.0, self._busy_s / max(1e-9, time.monotonic() - self._started)),
        )

    # --- decoding ----------------------------------------------------------------------

    async def _decode(
        self, request: _Request, prompt_ids: list[int], params: SamplingParams, n: int, max_tokens: int
    ) -> list[Generation]:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        texts: list[str | None] = [None] * n  # the text cut after a stop string
        cache: Any = None
        inputs = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        while max_tokens and None in reasons:
            await self._wait_runnable(request)
            if request.aborted.is_set():
                break
            async with self._lock:
                if self.paused:  # paused while this request queued for the lock
                    continue
                version = self.model_step
                began = time.monotonic()
                chosen, chosen_logprobs, cache = await _in_thread(
                    self._step, inputs, cache, n, params, generator
                )
                self._busy_s += time.monotonic() - began
            for i in range(n):
                if reasons[i] is not None:  # finished: keeps decoding in the batch, ignored
                    continue
                tokens[i].append(chosen[i])
                logprobs[i].append(chosen_logprobs[i])
                versions[i].append(version)
                reasons[i] = self._finished(tokens[i], params, stops, max_tokens, texts, i)
            inputs = torch.tensor(chosen, dtype=torch.long, device=self.device).unsqueeze(1)
            if request.aborted.is_set():
                break
        out = []
        for i in range(n):
            reason = reasons[i] or (FINISH_ABORT if request.aborted.is_set() else FINISH_LENGTH)
            text = texts[i]
            text = self._text(tokens[i]) if text is None else text
            ids = np.asarray(tokens[i], dtype=ID_DTYPE)
            steps = np.asarray(versions[i], dtype=ID_DTYPE)
            out.append(
                Generation(ids, np.asarray(logprobs[i], dtype=LOGPROB_DTYPE), steps, reason, text=text)
            )
        return out

    def _finished(
        self,
        ids: list[int],
        params: SamplingParams,
        stops: set[int],
        max_tokens: int,
        texts: list[str | None],
        i: int,
    ) -> str | None:
        if ids[-1] in stops:
            return FINISH_STOP
        if params.stop:
            # The text of the last few tokens, not of the last one: a stop string can span
            # tokens, and a token may be part of a character (byte-level BPE). Not the whole
            # text either: decoding it at every step is quadratic in the response length
            window = 4 * max(len(s) for s in params.stop) + 8
            if any(s and s in self._text(ids[-window:]) for s in params.stop):
                text = self._text(ids)
                hits = [text.find(s) + len(s) for s in params.stop if s and s in text]
                texts[i] = text[: min(hits)] if hits else text
                return FINISH_STOP
        return FINISH_LENGTH if len(ids) >= max_tokens else None

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    async def _wait_runnable(self, request: _Request) -> None:
        if self._resumed.is_set():
            return
        waits = [asyncio.ensure_future(self._resumed.wait()), asyncio.ensure_future(request.aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    @torch.no_grad()
    def _step(
        self,
        inputs: torch.Tensor,
        cache: Any,
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[list[int], list[float], Any]:
        """One forward pass (in a worker thread: no_grad is per thread, hence here) and
        the next token of each sample. The prompt's prefill runs once and its cache is
        repeated n times."""
        out = self.model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        cache = out.past_key_values
        if logits.shape[0] != n:
            logits = logits.repeat(n, 1)
            cache.batch_repeat_interleave(n)
        logp = torch.log_softmax(logits, dim=-1)
        if params.temperature <= 0:
            chosen = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / params.temperature, dim=-1)
            if params.top_p < 1.0:
                probs = _top_p(probs, params.top_p)
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        chosen_logp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
        return chosen.tolist(), chosen_logp.tolist(), cache

    def _load_weights(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise EngineError(f"hf engine: no *.safetensors in {str(path)!r}")
        state: dict[str, torch.Tensor] = {}
        try:
            for file in files:
                state.update(load_file(file))
        except (OSError, SafetensorError) as exc:
            raise EngineError(f"hf engine: cannot read the weights in {str(path)!r}: {exc}") from exc
        params = self.model.state_dict()
        # save_pretrained leaves tied weights (lm_head = embeddings) out of the files,
        # so strict loading would refuse them: check the fit here, before copying
        # anything (load_state_dict copies what fits before it raises on the rest)
        loaded = {params[k].data_ptr() for k in state if k in params}
        missing = [k for k in params if k not in state and params[k].data_ptr() not in loaded]
        unexpected = [k for k in state if k not in params]
        shapes = [k for k in state if k in params and state[k].shape != params[k].shape]
        if missing or unexpected or shapes:
            raise EngineError(
                f"hf engine: weights at {str(path)!r} do not fit the model: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {shapes[:3]}"
            )
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)


async def _in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """fn in a worker thread, so the event loop serves abort, pause and health meanwhile.
    A cancelled caller still waits for the thread: the lock it holds must not be
    released while the model is busy (a weight load would race the forward pass)."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the first
    token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs[before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def from_settings(settings: EngineSettings) -> HFEngine:
    """The engine of ``engines.kind = "hf"``."""
    return HFEngine(settings.hf)
