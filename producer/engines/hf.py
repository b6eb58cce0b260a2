"""The Hugging Face engine: transformers on one device, CPU or GPU, for small real runs
and tests.

One decode thread per engine owns the model and the device. It runs step after step
without handing back to the event loop: requests, aborts, pauses and new weights
reach it through a queue and flags that it looks at between two steps, and each
request's result goes back to the caller's event loop when the request ends. The
rows (samples) of every running request decode together in one forward pass a
step (see hf_decode: requests join and leave the batch at step boundaries);
sampling and logprobs stay on the device, and one host sync a step brings the
chosen tokens and their logprobs back.

The decode loop is our own rather than ``model.generate`` so that every step is a
point where the engine can stop (abort), wait (pause) or take new weights, and so
that each token carries its logprob and the model step that produced it.

Logprobs are of the model's raw distribution, log_softmax of the untempered
logits, whatever temperature and top_p did to the sampling: that is what the
trainer recomputes. A stop string ends a sample at the token that completes it:
the response ids and text both keep the stop string (the text is cut right after
it), as EOS and stop_token_ids are kept, so text and ids agree.

New weights are read (and checked against the model: hf_weights.py) outside the decode
thread, while decoding goes on; the thread copies them in between two steps.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.producer.engines import hf_decode, hf_weights
from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    EngineHealth,
    Generation,
    SamplingParams,
    local_model,
)
from rollstream.producer.engines.hf_decode import Batch, Row
from rollstream.shared.engine_settings import EngineSettings, HFEngineSettings
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IDLE_EXIT_S = 10.0  # an idle decode thread ends; the next request starts another
log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    max_tokens: int
    stops: set[int]
    generator: torch.Generator | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[Generation]]
    aborted: bool = False
    rows: list[Row] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Call:
    """Something to run in the decode thread between two steps (a weight copy, a barrier)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class HFEngine:
    def __init__(self, settings: HFEngineSettings, model_step: int = 0) -> None:
        settings, path = local_model(settings, "hf")  # a known model: its cached conversion
        self.settings = settings
        self.model_step = model_step
        self.paused = False
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
        self._params = dict(self.model.state_dict())
        self._sources: dict[str, str] = {}  # where each tensor was last read from (transports)
        # the loaded weights of the layers a LoRA adapter has come for (hf_weights.merge_adapters)
        self._lora_base: dict[str, torch.Tensor] = {}
        # buffers a shared-memory transport copies new weights into, reused from sync to sync
        # (fresh ones faulted every page in again: ~3x the load); one sync uses them at a time
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_busy = False
        self._requests: dict[str, _Request] = {}
        self._started = time.monotonic()
        self._busy_s = 0.0  # in forward passes, since the start: health's busy_total
        # the decode thread's side: its inbox, and the batches it owns
        self._inbox: queue.SimpleQueue[_Request | _Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._pending: list[_Request] = []  # accepted, not yet prefilled
        self._batches: list[Batch] = []
        self._stopping = False
        _ENGINES.add(self)

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
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise EngineError(f"hf engine: request {request_id!r} is already in flight")
        if not prompt_ids:
            raise EngineError("hf engine: empty prompt")
        max_tokens = params.max_tokens
        if self._context:
            max_tokens = min(max_tokens, self._context - len(prompt_ids))
            if max_tokens <= 0 < params.max_tokens:
                raise EngineError(f"hf engine: a prompt of {len(prompt_ids)} tokens fills the context")
        if max_tokens <= 0:
            empty = np.zeros(0, dtype=ID_DTYPE)
            return [Generation(empty, empty.astype(LOGPROB_DTYPE), empty, FINISH_LENGTH) for _ in range(n)]
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.device).manual_seed(params.seed)
        loop = asyncio.get_running_loop()
        request = _Request(
            request_id,
            list(prompt_ids),
            params,
            n,
            max_tokens,
            set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos),
            generator,
            loop,
            loop.create_future(),
        )
        self._requests[request_id] = request
        try:
            self._send(request)
            return await request.future
        except asyncio.CancelledError:
            request.aborted = True  # the thread drops its rows at the next step boundary
            self._send(None)
            raise
        finally:
            del self._requests[request_id]

    async def abort(self, request_ids: list[str] | None = None) -> int:
        ids = list(self._requests) if request_ids is None else [r for r in request_ids if r in self._requests]
        for request_id in ids:
            self._requests[request_id].aborted = True
        if ids:
            self._send(None)  # a wake-up: a paused or idle thread answers aborts at once
        return len(ids)

    async def pause(self) -> None:
        """Returns once the step in flight (if any) is done: no step runs until resume."""
        self.paused = True
        await self._call(lambda: None)

    async def resume(self) -> None:
        self.paused = False
        self._send(None)

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        """Read the weights (a directory of safetensors, or a transport's URI) while decoding
        goes on, then copy them in between two decode steps; later tokens carry
        ``model_step``."""
        state: dict[str, torch.Tensor] = {}
        sources = self._sources
        staging = None if self._staging_busy else self._staging
        self._staging_busy = True
        try:
            if path:
                state, sources = await asyncio.to_thread(
                    hf_weights.read_weights, path, sources, self._params, self._lora_base, staging
                )

            def apply() -> None:
                with torch.no_grad():
                    for name, tensor in state.items():
                        self._params[name].copy_(tensor, non_blocking=True)
                    if state and self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                self._sources = sources
                self.model_step = model_step

            await self._call(apply)
        finally:
            if staging is not None:
                self._staging_busy = False

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

    # --- the hand-off ------------------------------------------------------------------

    def _send(self, item: _Request | _Call | None) -> None:
        with self._thread_lock:
            self._inbox.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf-decode", daemon=True)
                self._thread.start()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """fn in the decode thread between two steps. A cancelled caller still waits for
        it: a weight copy must not be left half done behind the caller's back."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop, loop.create_future())
        self._send(call)
        return await _uncancellable(call.future)

    # --- the decode thread -------------------------------------------------------------

    def stop(self) -> None:
        """End the decode thread (at exit: torch must not be mid-step while the interpreter
        goes away). Requests still running are aborted with what they have."""
        self._stopping = True
        with self._thread_lock:
            thread = self._thread
            self._inbox.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopping:
            runnable = not self.paused and bool(self._batches or self._pending)
            try:
                item = self._inbox.get_nowait() if runnable else self._inbox.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                if runnable:
                    item = None
                else:
                    with self._thread_lock:
                        if self._inbox.empty() and not self._batches and not self._pending:
                            self._thread = None
                            return
                    continue
            self._take(item)
            while not self._inbox.empty():
                self._take(self._inbox.get_nowait())
            self._drop_aborted()
            if self.paused:
                continue
            try:
                self._advance()
            except Exception as exc:  # torch's errors (out of memory, device lost): fail them
                log.exception("hf engine: decode step failed")
                for request in self._running():
                    _resolve(request, EngineError(f"hf engine: request {request.request_id!r} failed: {exc}"))
                self._batches.clear()
                self._pending.clear()
        for request in self._running():
            request.aborted = True
            self._finish(request)
        self._batches.clear()
        self._pending.clear()
        with self._thread_lock:
            self._thread = None

    def _take(self, item: _Request | _Call | None) -> None:
        if isinstance(item, _Request):
            self._pending.append(item)
        elif isinstance(item, _Call) and item.future is not None:
            try:
                _resolve_call(item, item.fn(), None)
            except Exception as exc:  # handed to the caller
                _resolve_call(item, None, exc)

    def _running(self) -> list[_Request]:
        seen: dict[int, _Request] = {id(r): r for r in self._pending}
        for batch in self._batches:
            for row in batch.rows:
                seen[id(row.owner)] = row.owner
        return list(seen.values())

    def _drop_aborted(self) -> None:
        for request in [r for r in self._pending if r.aborted]:
            self._pending.remove(request)
            self._finish(request)
        for batch in self._batches:
            if any(row.owner.aborted for row in batch.rows):
                self._leave(batch, {id(r.owner): r.owner for r in batch.rows if r.owner.aborted})

    def _leave(self, batch: Batch, ending: dict[int, _Request]) -> None:
        keep = [i for i, row in enumerate(batch.rows) if id(row.owner) not in ending]
        if keep:
            hf_decode.select(batch, keep)
            batch.sampling = hf_decode.sampling_for(batch.rows, _params_of, self.device)
        else:
            self._batches.remove(batch)
        for request in ending.values():
            self._finish(request)

    def _advance(self) -> None:
        """Prefill what waits, merge it in, then one decode step of every batch."""
        fresh = None
        if self._pending:
            requests, self._pending = self._pending, []
            fresh = self._prefill(requests)
        for batch in list(self._batches):
            self._decode(batch)
        if fresh is not None:
            target = next((b for b in self._batches if hf_decode.mergeable(b.cache)), None)
            if target is not None and hf_decode.mergeable(fresh.cache):
                hf_decode.merge(target, fresh)
                target.sampling = hf_decode.sampling_for(target.rows, _params_of, self.device)
            else:
                self._batches.append(fresh)

    def _prefill(self, requests: list[_Request]) -> Batch | None:
        rows: list[Row] = []
        for request in requests:
            request.rows = [Row(request) for _ in range(request.n)]
            rows.extend(request.rows)
        inputs, mask = hf_decode.prompt_batch([r.prompt_ids for r in requests], self.device)
        sampling = hf_decode.sampling_for(rows, _params_of, self.device)
        batch = Batch(rows, None, inputs, mask, None, sampling)
        batch.positions = None if mask is None else mask.sum(dim=1)
        self._decode(batch, counts=[r.n for r in requests])
        return batch if batch.rows else None

    def _decode(self, batch: Batch, counts: list[int] | None = None) -> None:
        version = self.model_step
        began = time.monotonic()
        chosen, logprobs = self._step(batch, counts)
        self._busy_s += time.monotonic() - began
        ending: dict[int, _Request] = {}
        for row, token, logprob in zip(batch.rows, chosen, logprobs, strict=True):
            if row.reason is not None:  # finished: keeps decoding in the batch, ignored
                continue
            row.tokens.append(int(token))
            row.logprobs.append(logprob)
            row.versions.append(version)
            request = row.owner
            row.reason = self._finished(row, request.params, request.stops, request.max_tokens)
            if row.reason is not None and all(r.reason is not None for r in request.rows):
                ending[id(request)] = request
        if ending:
            if batch in self._batches:
                self._leave(batch, ending)
            else:  # a fresh batch: done in its prefill
                keep = [i for i, row in enumerate(batch.rows) if id(row.owner) not in ending]
                if keep:
                    hf_decode.select(batch, keep)
                    batch.sampling = hf_decode.sampling_for(batch.rows, _params_of, self.device)
                else:
                    batch.rows = []
                for request in ending.values():
                    self._finish(request)

    def _step(self, batch: Batch, counts: list[int] | None = None) -> tuple[list[float], list[float]]:
        """One forward pass of the batch (hf_decode.step): tests count them here."""
        return hf_decode.step(self.model, batch, counts)

    def _finish(self, request: _Request) -> None:
        out = []
        rows = request.rows or [Row(request) for _ in range(request.n)]
        for row in rows:
            reason = row.reason or (FINISH_ABORT if request.aborted else FINISH_LENGTH)
            text = row.text if row.text is not None else self._text(row.tokens)
            ids = np.asarray(row.tokens, dtype=ID_DTYPE)
            steps = np.asarray(row.versions, dtype=ID_DTYPE)
            logprobs = np.asarray(row.logprobs, dtype=LOGPROB_DTYPE)
            out.append(Generation(ids, logprobs, steps, reason, text=text))
        _resolve(request, out)

    def _finished(self, row: Row, params: SamplingParams, stops: set[int], max_tokens: int) -> str | None:
        ids = row.tokens
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
                row.text = text[: min(hits)] if hits else text
                return FINISH_STOP
        return FINISH_LENGTH if len(ids) >= max_tokens else None

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


_ENGINES: weakref.WeakSet[HFEngine] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for engine in list(_ENGINES):
        engine.stop()


def _params_of(request: _Request) -> SamplingParams:
    return request.params


def _resolve(request: _Request, value: list[Generation] | BaseException) -> None:
    def settle() -> None:
        if request.future.done():  # cancelled meanwhile
            return
        if isinstance(value, BaseException):
            request.future.set_exception(value)
        else:
            request.future.set_result(value)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits for it
        request.loop.call_soon_threadsafe(settle)


def _resolve_call(call: _Call, value: Any, exc: BaseException | None) -> None:
    def settle() -> None:
        if call.future.done():
            return
        if exc is not None:
            call.future.set_exception(exc)
        else:
            call.future.set_result(value)

    with contextlib.suppress(RuntimeError):
        call.loop.call_soon_threadsafe(settle)


async def _uncancellable(future: asyncio.Future[Any]) -> Any:
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


def from_settings(settings: EngineSettings) -> HFEngine:
    """The engine of ``engines.kind = "hf"``."""
    return HFEngine(settings.hf)
