"""Engines on servers the user runs, reached over HTTP: ``openai`` (an OpenAI-compatible
server, vLLM's first of all) and ``sglang`` (SGLang's native API).

RL needs token ids in and token ids, logprobs and per-token model steps out, plus
abort, pause and weight loading: more than the OpenAI API says. So each engine finds
out once per server what that server has, and uses the best of it:

- ``openai`` sends token ids to vLLM's token endpoint, ``/inference/v1/generate``
  (``--enable-scale-out``), which also returns the weight version of every token;
  otherwise ``/v1/completions`` with the prompt as token ids and ``return_token_ids``.
  Abort, pause, weight loading and version labels go to vLLM's control endpoints
  (``/abort_requests``, ``/pause``, ``/collective_rpc``, ``/update_weight_version``,
  ``/resume``; ``VLLM_SERVER_DEV_MODE=1``) where the server has them; where it has
  not, the operation that needs one fails with an EngineError that names what is
  missing and what to do instead.
- ``sglang`` sends the n samples as a batch of n identical prompts (SGLang's advice
  for n > 1, and it gives each sample a request id of ours to abort it by), reads the
  logprobs from ``meta_info``, and controls the server with ``/abort_request``,
  ``/pause_generation`` (mode "retract": running requests keep their tokens and go
  back to the queue, their KV cache is recomputed with the new weights),
  ``/update_weights_from_disk`` and ``/continue_generation``.

Per-token model steps come from the server's weight-version spans when it returns
them (the engine labels each weight version with its model step); without spans,
every token carries the step the engine held when the request started — the oldest
it can be, which is the safe side for staleness.

Several servers per engine: a request goes to the one with the fewest requests
outstanding from this engine. A server that does not answer (connection refused or
reset, timeout, 502/503/504) is taken out for ``retry_s`` and the request goes to the
next one; when it comes back it is brought to the engine's current weights before it
serves. When every server is out, the EngineError names them all. Messages name
URLs without passwords and never carry the api key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote

import httpx
import numpy as np

from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    EngineHealth,
    Generation,
    SamplingParams,
)
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE
from rollstream.shared.settings import EngineSettings, HTTPEngineSettings, redact_url

logger = logging.getLogger(__name__)

_UNAVAILABLE = (
    429,
    502,
    503,
    504,
)  # overloaded or rate-limited, a proxy without a backend, a server starting
_HEALTH_TIMEOUT_S = 2.0  # a health probe of a server that was out (health answers within 5 s)
_CONTROL_TIMEOUT_S = 30.0  # capability probes and aborts (a busy server builds its schema slowly)
_ABORT_RETRY_S = 0.25  # an abort can reach a server before the request does: send it again
_ABORT_TRIES = 40
_ERROR_TEXT = 300  # characters of a server's error reply kept in our messages
_now = time.monotonic  # the clock of take-outs and busy time (tests move their own)

# vLLM's endpoints (the openai kind)
TOKENS = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
TOKENS_ABORT = "/inference/v1/abort_requests"  # beside the token endpoint (--enable-scale-out)
DEV_ABORT = "/abort_requests"  # dev mode (VLLM_SERVER_DEV_MODE=1)
PAUSE = "/pause"
RESUME = "/resume"
RPC = "/collective_rpc"
WEIGHT_VERSION = "/update_weight_version"
FROM_DISK = "/update_weights_from_disk"  # SGLang's (an OpenAI-kind server may have it too)
# rollstream's vLLM worker extension (vllm_worker.py), a reload that also moves a tied
# lm_head: a server started with --worker-extension-cls WORKER_EXTENSION has the method
WORKER_EXTENSION = "rollstream.producer.engines.vllm_worker.WeightReloader"
RELOAD_METHOD = "rollstream_reload_weights"


class _Unreachable(Exception):
    """The server did not answer: it is taken out and the work goes elsewhere."""


@dataclass(eq=False)
class _Server:
    url: str  # base URL, no trailing slash
    name: str  # the URL as messages show it (no password)
    index: int
    outstanding: int = 0
    down_until: float = 0.0  # monotonic time before which it is out
    error: str = ""  # why it was taken out
    paths: set[str] | None = None  # endpoints it has (None: not probed since it was last out)
    step: int | None = None  # the model step of its weights, as far as this engine knows
    text_mode: bool = True  # the token endpoint may detokenize (a --tokens-only server cannot)
    extension: bool | None = None  # runs rollstream's vLLM worker extension (None: not known yet)
    auth: httpx.BasicAuth | None = None  # the URL's user info, kept out of the URL httpx logs


@dataclass(eq=False)
class _Call:
    """One generate request in flight."""

    request_id: str
    server_id: str  # the id the server knows it by (ours, prefixed with the engine's tag)
    server: _Server | None = None
    abort_ids: list[str] = field(default_factory=list)  # what the server's abort endpoint takes
    aborted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    exchange: asyncio.Future[Any] | None = None  # the HTTP exchange, cancelled to abort without an endpoint


class _Busy:
    """Share of wall time with at least one request outstanding: the engine knows
    nothing of the server's capacity, so this is what it can say of its own use."""

    def __init__(self) -> None:
        self.start = self.last = self.window = _now()
        self.busy_window = self.busy_total = 0.0
        self.outstanding = 0

    def add(self, delta: int) -> None:
        self._accrue()
        self.outstanding += delta

    def _accrue(self) -> None:
        now = _now()
        if self.outstanding:
            self.busy_window += now - self.last
            self.busy_total += now - self.last
        self.last = now

    def read(self) -> tuple[float, float]:
        """(since the last read, since the start)."""
        self._accrue()
        window, total = self.last - self.window, self.last - self.start
        fraction = self.busy_window / window if window > 0 else float(self.outstanding > 0)
        overall = self.busy_total / total if total > 0 else float(self.outstanding > 0)
        self.busy_window, self.window = 0.0, self.last
        return min(1.0, fraction), min(1.0, overall)


class HTTPEngine:
    """What both kinds share: servers, load balancing, take-out and retry, errors."""

    kind: ClassVar[str] = "http"
    alive_path: ClassVar[str] = "/health"  # a cheap GET that answers when the server is up

    def __init__(
        self,
        settings: HTTPEngineSettings,
        model_step: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.model_step = model_step
        self.paused = False
        self._servers: list[_Server] = []
        for i, url in enumerate(_base_urls(settings.urls, self.kind)):
            base, auth = _without_userinfo(url)
            self._servers.append(_Server(base, redact_url(url), i, step=model_step, auth=auth))
        self._transport = transport  # tests put a fake server here
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._tag = uuid.uuid4().hex[:8]  # server-side ids of two engines sharing a server never collide
        self._calls: dict[str, _Call] = {}
        self._path: str | None = None  # the weights of model_step, once the engine loaded any
        self._weights = asyncio.Lock()  # one weight load at a time, updates and re-syncs alike
        self._paused_on: list[_Server] = []
        self._busy = _Busy()
        self._warned: set[str] = set()
        self._aborts: set[asyncio.Future[None]] = set()

    # --- the protocol ----------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._calls:
            raise EngineError(f"{self.kind} engine: request {request_id!r} is already in flight")
        if not prompt_ids:
            raise EngineError(f"{self.kind} engine: empty prompt")
        if n < 1:
            raise EngineError(f"{self.kind} engine: n must be at least 1, not {n}")
        call = _Call(request_id, f"{self._tag}-{request_id}")
        start_step = self.model_step
        self._calls[request_id] = call
        self._busy.add(1)
        try:
            return await self._dispatch(
                call, lambda server: self._generate_on(server, call, prompt_ids, params, n, start_step), n
            )
        finally:
            self._busy.add(-1)
            call.done.set()
            del self._calls[request_id]

    async def abort(self, request_ids: list[str] | None = None) -> int:
        ids = list(self._calls) if request_ids is None else [r for r in request_ids if r in self._calls]
        for request_id in ids:
            call = self._calls[request_id]
            if not call.aborted:
                call.aborted = True
                task = asyncio.ensure_future(self._abort_until_done(call))
                self._aborts.add(task)  # held until done: the loop keeps only weak references
                task.add_done_callback(self._aborts.discard)
        return len(ids)

    async def pause(self) -> None:
        # under the weights lock: a weight load's own hold (pause, load, resume) and a
        # returning server brought to the weights and the pause (_ready) see no change
        async with self._weights:
            servers = []
            for server in self._up():
                try:
                    await self._check_can_pause(server)
                    servers.append(server)
                except _Unreachable as exc:  # paused when it comes back (_ready)
                    self._take_out(server, exc)
            if not servers:
                raise EngineError(self._all_out())
            paused: list[_Server] = []
            try:
                for server in servers:
                    try:
                        await self._pause_on(server)
                        paused.append(server)
                    except _Unreachable as exc:
                        self._take_out(server, exc)
            except BaseException:
                await self._resume_each(paused)
                raise
            if not paused:
                raise EngineError(self._all_out())
            self._paused_on = paused
            self.paused = True

    async def resume(self) -> None:
        async with self._weights:
            paused, self._paused_on = self._paused_on, []
            self.paused = False
            await self._resume_each(paused)

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        async with self._weights:
            servers = self._up()
            if not servers:
                raise EngineError(self._all_out())
            results = await asyncio.gather(
                *(self._load_on(server, model_step, path) for server in servers), return_exceptions=True
            )
            loaded = 0
            for server, result in zip(servers, results, strict=True):
                if isinstance(result, _Unreachable):
                    self._take_out(server, result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    loaded += 1
            if not loaded:
                raise EngineError(self._all_out())
            self.model_step = model_step
            if path is not None:
                self._path = path

    async def health(self) -> EngineHealth:
        await self._probe_returning()
        busy, total = self._busy.read()
        up = self._up()
        out = [f"{s.name} ({s.error})" for s in self._servers if s not in up]
        detail = f"{self.kind}: {len(up)} of {len(self._servers)} servers up"
        if out:
            detail += "; out: " + ", ".join(out)
        return EngineHealth(
            healthy=bool(up),
            model_step=self.model_step,
            paused=self.paused,
            outstanding=len(self._calls),
            running=len(self._calls),
            queued=0,
            busy_fraction=busy,
            detail=detail,
            busy_total=total,
        )

    async def aclose(self) -> None:
        """Close the HTTP connections (tests; an engine actor keeps them for its life)."""
        for task in list(self._aborts):  # nothing left asking the server once it is closed
            task.cancel()
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = None

    # --- what each kind implements -----------------------------------------------------

    async def _generate_on(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
    ) -> list[Generation]:
        raise NotImplementedError

    async def _abort_on(self, server: _Server, call: _Call) -> bool | None:
        """Ask the server to abort the call: True when asked, False when the server has
        no way to, None when the call has not reached the point of asking yet."""
        raise NotImplementedError

    async def _check_can_pause(self, server: _Server) -> None:
        raise NotImplementedError

    async def _pause_on(self, server: _Server) -> None:
        raise NotImplementedError

    async def _resume_on(self, server: _Server) -> None:
        raise NotImplementedError

    async def _load_on(self, server: _Server, model_step: int, path: str | None) -> None:
        """Load the weights at ``path`` (None: only label the version) on one server."""
        raise NotImplementedError

    # --- dispatch, take-out and retry ----------------------------------------------------

    async def _dispatch(
        self, call: _Call, send: Callable[[_Server], Awaitable[list[Generation]]], n: int
    ) -> list[Generation]:
        """send on the least-loaded server that is up; on to the next when one does not answer."""
        tried: set[int] = set()
        while True:
            server = self._pick(tried)
            tried.add(server.index)
            server.outstanding += 1
            call.server = server
            try:
                try:
                    await self._ready(server)
                except EngineError as exc:  # it cannot take the engine's weights: out, as if down
                    raise _Unreachable(str(exc)) from exc
                if call.aborted:  # while it waited: not sent at all
                    return [_aborted(self.model_step) for _ in range(n)]
                return await send(server)
            except _Unreachable as exc:
                self._take_out(server, exc)
                if call.aborted:  # not worth a new start elsewhere
                    return [_aborted(self.model_step) for _ in range(n)]
            finally:
                server.outstanding -= 1
                call.server = None

    def _pick(self, tried: set[int]) -> _Server:
        now = _now()
        candidates = [s for s in self._servers if s.index not in tried and s.down_until <= now]
        if not candidates:
            raise EngineError(self._all_out())
        return min(candidates, key=lambda s: (s.outstanding, s.index))

    def _up(self) -> list[_Server]:
        """Servers not taken out (those whose retry time has come count as up)."""
        now = _now()
        return [s for s in self._servers if s.down_until <= now]

    def _take_out(self, server: _Server, exc: BaseException) -> None:
        server.down_until = _now() + self.settings.retry_s
        server.error = self._scrub(str(exc)) or type(exc).__name__
        server.paths = None  # it may come back as another server (restarted with other flags)
        server.step = None  # and with other weights
        server.extension = None
        logger.warning(
            "%s engine: %s taken out for %s s: %s",
            self.kind,
            server.name,
            self.settings.retry_s,
            server.error,
        )

    def _all_out(self) -> str:
        servers = ", ".join(f"{s.name} ({s.error or 'out'})" for s in self._servers)
        return (
            f"{self.kind} engine: no server answers: {servers}; each is tried again "
            f"{self.settings.retry_s} s after it failed"
        )

    async def _ready(self, server: _Server) -> None:
        """A server back from being out holds unknown weights: load the engine's."""
        if server.step == self.model_step:
            return
        async with self._weights:
            if server.step == self.model_step:
                return
            # pause and resume hold the lock too: self.paused holds still until it is released
            if self.paused:  # it missed the pause too: paused first, so it loads standing still
                await self._check_can_pause(server)
                await self._pause_on(server)
                if server not in self._paused_on:
                    self._paused_on.append(server)
            if self._path is None:  # never loaded any: the server keeps what it was started with
                server.step = self.model_step
                return
            logger.info("%s engine: loading model step %d on %s", self.kind, self.model_step, server.name)
            await self._load_on(server, self.model_step, self._path)

    async def _probe_returning(self) -> None:
        """Health probes of the servers whose retry time has come, so that health
        tells whether they are back before a request finds out."""
        now = _now()
        returning = [s for s in self._servers if s.error and s.down_until <= now]

        async def probe(server: _Server) -> None:
            try:
                await self._request(server, "GET", self.alive_path, timeout=_HEALTH_TIMEOUT_S)
            except _Unreachable as exc:
                self._take_out(server, exc)
            except EngineError:
                pass  # it answers: a request will find out the rest
            else:
                logger.info("%s engine: %s answers again", self.kind, server.name)
                server.error = ""

        await asyncio.gather(*(probe(s) for s in returning))

    async def _abort_until_done(self, call: _Call) -> None:
        """Abort on the server until the request returns: the abort may overtake the
        request, and a server that has not seen an id ignores its abort."""
        for _ in range(_ABORT_TRIES):
            if call.done.is_set():
                return
            server = call.server
            if server is not None:
                try:
                    asked = await self._abort_on(server, call)
                except (_Unreachable, EngineError) as exc:
                    logger.warning("%s engine: abort of %r failed: %s", self.kind, call.request_id, exc)
                    asked = None
                if asked is False and call.exchange is not None:
                    self._warn_once(
                        "abort",
                        f"{self.kind} engine: {server.name} has no abort endpoint: an aborted request "
                        "is cut off and returns without its tokens (vLLM: start the server with "
                        "VLLM_SERVER_DEV_MODE=1 or --enable-scale-out)",
                    )
                    call.exchange.cancel()
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(call.done.wait(), _ABORT_RETRY_S)
        if not call.done.is_set():
            logger.warning(
                "%s engine: gave up asking the server to abort %r after %d tries: a request "
                "not sent yet will not be, one sent may run to its end",
                self.kind,
                call.request_id,
                _ABORT_TRIES,
            )

    async def _resume_each(self, servers: Iterable[_Server]) -> None:
        for server in servers:
            try:
                await self._resume_on(server)
            except _Unreachable as exc:
                self._take_out(server, exc)

    # --- HTTP --------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        """The client of the running event loop (an httpx client must not cross loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
            timeout = httpx.Timeout(self.settings.timeout_s, connect=min(10.0, self.settings.timeout_s))
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                headers=headers, timeout=timeout, limits=limits, transport=self._transport
            )
            self._client_loop = loop
        return self._client

    async def _request(
        self,
        server: _Server,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        call: _Call | None = None,
    ) -> Any:
        """The decoded JSON reply (or text); _Unreachable when the server does not
        answer, EngineError when it answers with an error."""
        kwargs: dict[str, Any] = {"params": params, "headers": headers}
        if body is not None:
            kwargs["json"] = body
        if timeout is not None:
            kwargs["timeout"] = timeout
        if server.auth is not None:
            kwargs["auth"] = server.auth
        exchange = asyncio.ensure_future(self._http().request(method, server.url + path, **kwargs))
        if call is not None:
            call.exchange = exchange
        try:
            response = await exchange
        except httpx.TransportError as exc:
            if call is not None and isinstance(exc, httpx.ReadTimeout):
                raise await self._timed_out(server, path, call) from exc
            reason = f"{type(exc).__name__} on {path}" + (f": {exc}" if str(exc) else "")
            raise _Unreachable(reason) from exc
        finally:
            if call is not None:
                call.exchange = None
        if response.status_code in _UNAVAILABLE:
            raise _Unreachable(f"HTTP {response.status_code} from {path}")
        if response.status_code >= 400:
            raise _HTTPStatus(
                response.status_code,
                f"{self.kind} engine: {server.name}{path} answered HTTP {response.status_code}: "
                f"{self._scrub(_error_text(response))}",
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    async def _timed_out(self, server: _Server, path: str, call: _Call) -> EngineError:
        """A generation that outlasted timeout_s: the server is up, busy with it; it is
        asked to abort it (best effort) and stays in."""
        asked: bool | None = None
        with contextlib.suppress(_Unreachable, EngineError):
            asked = await self._abort_on(server, call)
        return EngineError(
            f"{self.kind} engine: a generation on {server.name}{path} exceeded "
            f"engines.{self.kind}.timeout_s = {self.settings.timeout_s} s"
            + ("; the server was asked to abort it" if asked else "")
        )

    async def _paths(self, server: _Server, candidates: dict[str, tuple[str, str, Any]]) -> set[str]:
        """The endpoints of ``candidates`` (path -> harmless probe: method, path, body)
        the server has: from its OpenAPI schema, else one probe each (any answer but
        404 / 405 means the endpoint is there). Cached until the server is taken out."""
        if server.paths is not None:
            return server.paths
        found: set[str] | None = None
        try:
            schema = await self._request(server, "GET", "/openapi.json", timeout=self._control_timeout)
            if isinstance(schema, dict) and isinstance(schema.get("paths"), dict):
                found = set(schema["paths"]) & set(candidates)
        except EngineError:
            pass
        if found is None:
            found = set()
            for path, (method, probe_path, body) in candidates.items():
                try:
                    await self._request(server, method, probe_path, body, timeout=self._control_timeout)
                    found.add(path)
                except _HTTPStatus as exc:
                    if exc.status not in (404, 405):
                        found.add(path)
        logger.info(
            "%s engine: %s has %s", self.kind, server.name, ", ".join(sorted(found)) or "none of them"
        )
        server.paths = found
        return found

    @property
    def _control_timeout(self) -> float:
        return min(_CONTROL_TIMEOUT_S, self.settings.timeout_s)

    def _scrub(self, text: str) -> str:
        key = self.settings.api_key
        return text.replace(key, "***") if key else text

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message)

    def _server_path(self, path: str) -> str:
        """The path to send; checked here first when the server sees the same path:
        vLLM told to reload from a directory that is not there fails half-way and its
        engine dies at the next step."""
        on_server = self.settings.weights_path_on_server
        if not on_server and not any(Path(path).glob("*.safetensors")):
            raise EngineError(
                f"{self.kind} engine: no *.safetensors at {path!r} as this process sees it; a server "
                'that sees the trainer\'s weights elsewhere needs weights_path_on_server ("LOCAL=SERVER", '
                'e.g. "/ckpt=/ckpt" when it sees them at the same path)'
            )
        return server_path(path, on_server)

    def _versions(self, spans: Any, count: int, start_step: int) -> np.ndarray:
        return token_versions(spans, count, start_step)


class _HTTPStatus(EngineError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OpenAIEngine(HTTPEngine):
    """An OpenAI-compatible server: vLLM's token endpoint when there, else /v1/completions."""

    kind = "openai"
    alive_path = "/v1/models"

    # endpoint -> a probe that changes nothing on a server that has it
    _CANDIDATES: ClassVar[dict[str, tuple[str, str, Any]]] = {
        TOKENS: ("POST", TOKENS, {}),
        TOKENS_ABORT: ("POST", TOKENS_ABORT, {"request_ids": ["rollstream-probe"]}),
        DEV_ABORT: ("POST", DEV_ABORT, {"request_ids": ["rollstream-probe"]}),
        PAUSE: ("GET", "/is_paused", None),  # /pause and /resume come with it
        RESUME: ("GET", "/is_paused", None),
        RPC: ("POST", RPC, {}),
        WEIGHT_VERSION: ("POST", WEIGHT_VERSION, {}),
        FROM_DISK: ("POST", FROM_DISK, {}),
    }

    async def _generate_on(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
    ) -> list[Generation]:
        paths = await self._paths(server, self._CANDIDATES)
        if call.aborted:  # while the endpoints were probed: not sent at all
            return [_aborted(start_step) for _ in range(n)]
        headers = {"X-Request-Id": call.server_id}  # vLLM takes it as the request's id
        try:
            if TOKENS in paths:
                return await self._tokens(server, call, prompt_ids, params, n, start_step, headers)
            return await self._completions(server, call, prompt_ids, params, n, start_step, headers)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.aborted and not (task is not None and task.cancelling()):
                return [_aborted(start_step) for _ in range(n)]  # cut off: no endpoint to abort with
            raise

    async def _tokens(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
        headers: dict[str, str],
    ) -> list[Generation]:
        sampling: dict[str, Any] = {"n": n, "logprobs": 0, **_vllm_sampling(params)}
        body: dict[str, Any] = {
            "request_id": call.server_id,
            "token_ids": prompt_ids,
            "sampling_params": sampling,
        }
        if self.settings.model:
            body["model"] = self.settings.model
        call.abort_ids = [f"generate-tokens-{call.server_id}"]
        if server.text_mode:
            body["output_mode"] = "text"  # the text too, for the judges (vLLM >= 0.32)
        try:
            reply = await self._request(server, "POST", TOKENS, body, headers=headers, call=call)
        except _HTTPStatus as exc:
            if not (server.text_mode and exc.status == 400 and "output_mode" in str(exc)):
                raise
            server.text_mode = False  # a server without a tokenizer: ids only
            del body["output_mode"]
            reply = await self._request(server, "POST", TOKENS, body, headers=headers, call=call)
        choices = _choices(reply, server, TOKENS, n)
        out = []
        for choice in choices:
            ids = choice.get("token_ids") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [entry["logprob"] for entry in content]
            versions = self._versions(choice.get("weight_versions"), len(ids), start_step)
            out.append(
                _generation(server, TOKENS, ids, logprobs, versions, choice.get("finish_reason"), choice)
            )
        return out

    async def _completions(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
        headers: dict[str, str],
    ) -> list[Generation]:
        body: dict[str, Any] = {"prompt": prompt_ids, "n": n, "logprobs": 0, "return_token_ids": True}
        body.update(_vllm_sampling(params))
        if self.settings.model:
            body["model"] = self.settings.model
        call.abort_ids = [f"cmpl-{call.server_id}-0"]  # vLLM's id of prompt 0 of the request
        reply = await self._request(server, "POST", COMPLETIONS, body, headers=headers, call=call)
        out = []
        for choice in _choices(reply, server, COMPLETIONS, n):
            ids = choice.get("token_ids")
            if ids is None:
                raise EngineError(
                    f"openai engine: {server.name}{COMPLETIONS} returned no token ids (it ignores "
                    "return_token_ids): rollstream needs the server's own token ids — run vLLM, or "
                    'SGLang with engines.kind = "sglang"'
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            versions = self._versions(None, len(ids), start_step)
            out.append(
                _generation(server, COMPLETIONS, ids, logprobs, versions, choice.get("finish_reason"), choice)
            )
        return out

    async def _reload(self, server: _Server, path: str, target: str) -> None:
        """Reload through rollstream's worker extension when the server runs it, else
        through vLLM's own reload_weights — which keeps the old lm_head of a model that
        ties it to the embeddings, so that is refused for such a model."""
        if server.extension is not False:
            try:
                await self._request(server, "POST", RPC, {"method": RELOAD_METHOD, "args": [target]})
                server.extension = True
                return
            except _HTTPStatus as exc:
                if f"no attribute '{RELOAD_METHOD}'" not in str(exc):
                    raise
                server.extension = False
                logger.info("%s engine: %s runs without %s", self.kind, server.name, WORKER_EXTENSION)
        tied = ties_lm_head(path)
        if tied:
            raise EngineError(
                f"openai engine: the model at {path!r} ties lm_head to the embeddings; {server.name} has "
                "only vLLM's reload_weights, which keeps the old lm_head of such a model (output "
                f"would not match the weights): start the server with --worker-extension-cls "
                f"{WORKER_EXTENSION} (rollstream installed beside vLLM)"
            )
        if tied is None:
            self._warn_once(
                "tied",
                f"openai engine: cannot read the weights at {path!r} here to tell whether the model "
                f"ties lm_head to the embeddings; if it does, vLLM's reload_weights on {server.name} "
                f"keeps the old lm_head — start the server with --worker-extension-cls {WORKER_EXTENSION}",
            )
        await self._request(
            server, "POST", RPC, {"method": "reload_weights", "kwargs": {"weights_path": target}}
        )

    async def _abort_on(self, server: _Server, call: _Call) -> bool | None:
        if server.paths is None or not call.abort_ids:
            return None  # the request is not on its way yet
        paths = server.paths
        endpoint = TOKENS_ABORT if TOKENS_ABORT in paths else DEV_ABORT if DEV_ABORT in paths else None
        if endpoint is None:
            return False
        await self._request(
            server, "POST", endpoint, {"request_ids": call.abort_ids}, timeout=self._control_timeout
        )
        return True

    async def _check_can_pause(self, server: _Server) -> None:
        if PAUSE not in await self._paths(server, self._CANDIDATES):
            raise EngineError(
                f"partial weight sync needs {PAUSE} on the server; {server.name} has none — use "
                "rollout.on_weight_sync = drain or abort, or start vLLM with VLLM_SERVER_DEV_MODE=1"
            )

    async def _pause_on(self, server: _Server) -> None:
        # keep: running requests stay, with their KV cache, and go on with the new weights
        await self._request(server, "POST", PAUSE, params={"mode": "keep", "clear_cache": "false"})

    async def _resume_on(self, server: _Server) -> None:
        await self._request(server, "POST", RESUME)

    async def _load_on(self, server: _Server, model_step: int, path: str | None) -> None:
        paths = await self._paths(server, self._CANDIDATES)
        version = str(model_step)
        if path is not None:
            target = self._server_path(path)
            if RPC in paths:
                # hold the server still while its weights change, unless a pause already does
                hold = not self.paused and PAUSE in paths
                if hold:
                    await self._pause_on(server)
                try:
                    await self._reload(server, path, target)
                    if WEIGHT_VERSION in paths:
                        await self._request(server, "POST", WEIGHT_VERSION, {"new_version": version})
                finally:
                    if hold:
                        await self._resume_on(server)
                server.step = model_step
                return
            if FROM_DISK in paths:
                reply = await self._request(
                    server, "POST", FROM_DISK, {"model_path": target, "weight_version": version}
                )
                _check_success(reply, server, FROM_DISK)
                server.step = model_step
                return
            raise EngineError(
                f"loading weights needs {RPC} (vLLM started with VLLM_SERVER_DEV_MODE=1) or "
                f"{FROM_DISK} on the server; {server.name} has neither"
            )
        if WEIGHT_VERSION in paths:
            await self._request(server, "POST", WEIGHT_VERSION, {"new_version": version})
        server.step = model_step


class SGLangEngine(HTTPEngine):
    """SGLang's native API: /generate with input_ids, logprobs from meta_info."""

    kind = "sglang"
    alive_path = "/get_model_info"
    # retract: running requests keep their tokens and wait in the queue; their KV cache
    # is recomputed with the new weights on continue (in_place would keep stale KV and
    # forbid the cache flush that the weight load does)
    pause_mode = "retract"

    async def _generate_on(
        self,
        server: _Server,
        call: _Call,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        start_step: int,
    ) -> list[Generation]:
        rids = [f"{call.server_id}-{i}" for i in range(n)]
        sampling = []
        for i in range(n):
            one: dict[str, Any] = {
                "max_new_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "ignore_eos": params.ignore_eos,
                "skip_special_tokens": True,
                "no_stop_trim": True,  # the text keeps its stop string, as the ids keep the stop token
            }
            if params.stop:
                one["stop"] = list(params.stop)
            if params.stop_token_ids:
                one["stop_token_ids"] = list(params.stop_token_ids)
            if params.seed is not None:
                one["sampling_seed"] = params.seed + i  # one seed for all would make n equal samples
            sampling.append(one)
        body = {
            "input_ids": [prompt_ids] * n,  # SGLang's advice for n > 1: the same prompt n times
            "rid": rids,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        call.abort_ids = rids
        reply = await self._request(server, "POST", "/generate", body, call=call)
        if isinstance(reply, dict):
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != n:
            raise EngineError(
                f"sglang engine: {server.name}/generate returned {_describe(reply)} for a batch of {n}"
            )
        out = []
        for item in reply:
            meta = item.get("meta_info") or {}
            pairs = meta.get("output_token_logprobs") or []
            ids = item.get("output_ids")
            if ids is None:
                ids = [pair[1] for pair in pairs]
            logprobs = [pair[0] for pair in pairs]
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind is None:
                kind = FINISH_ABORT if call.aborted else FINISH_STOP
            versions = self._versions(meta.get("weight_versions"), len(ids), start_step)
            out.append(_generation(server, "/generate", ids, logprobs, versions, kind, item))
        return out

    async def _abort_on(self, server: _Server, call: _Call) -> bool | None:
        if not call.abort_ids:
            return None
        for rid in call.abort_ids:
            await self._request(server, "POST", "/abort_request", {"rid": rid}, timeout=self._control_timeout)
        return True

    async def _check_can_pause(self, server: _Server) -> None:
        return None  # the native API always has it

    async def _pause_on(self, server: _Server) -> None:
        await self._request(server, "POST", "/pause_generation", {"mode": self.pause_mode})

    async def _resume_on(self, server: _Server) -> None:
        await self._request(server, "POST", "/continue_generation", {})

    async def _load_on(self, server: _Server, model_step: int, path: str | None) -> None:
        version = str(model_step)
        if path is None:
            # abort_all_requests defaults to true there: the running requests stay
            body = {"new_version": version, "abort_all_requests": False}
            await self._request(server, "POST", "/update_weight_version", body)
        else:
            body = {"model_path": self._server_path(path), "weight_version": version}
            _check_success(await self._request(server, "POST", FROM_DISK, body), server, FROM_DISK)
        server.step = model_step


# --- helpers -----------------------------------------------------------------------


def server_path(path: str, on_server: str) -> str:
    """Where the server finds the weights the trainer published at ``path``.

    ``weights_path_on_server`` is either ``LOCAL=SERVER`` (a path under the prefix LOCAL
    is sent as the same path under SERVER) or a directory D (the published directory,
    by its name, under D: a trainer that writes out_dir/step-N, a server that mounts
    out_dir at D). Empty: the same path.
    """
    if not on_server:
        return path
    if "=" in on_server:
        local, remote = (part.rstrip("/") for part in on_server.split("=", 1))
        if path == local or path.startswith(local + "/"):
            return remote + path[len(local) :]
        raise EngineError(
            f"weights at {path!r} are not under {local!r}, the local side of "
            f"weights_path_on_server = {on_server!r}"
        )
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return f"{on_server.rstrip('/')}/{name}"


def ties_lm_head(path: str) -> bool | None:
    """Whether the model published at ``path`` ties its lm_head to the embeddings and
    its files leave the lm_head out (what save_pretrained does); None when the
    directory cannot be read here. Reads only the config and the safetensors headers."""
    directory = Path(path)
    try:
        config = json.loads((directory / "config.json").read_text())
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return None
        names: set[str] = set()
        for file in files:
            with file.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                names.update(json.loads(handle.read(size)))
    except (OSError, ValueError):
        return None
    # PretrainedConfig ties by default: a config that does not say is a tied one
    return bool(config.get("tie_word_embeddings", True)) and "lm_head.weight" not in names


def token_versions(spans: Any, count: int, start_step: int) -> np.ndarray:
    """The model step of each of ``count`` tokens from weight-version spans (vLLM's
    ``[{"version", "start", "end"}]`` or ``[version, start, end]``; SGLang's the same
    dicts). A version this engine labelled is its model step; any other label (the
    server's initial "default") and any token no span covers get ``start_step``."""
    versions = np.full(count, start_step, dtype=ID_DTYPE)
    for span in spans or []:
        if isinstance(span, dict):
            label, start, end = span.get("version"), span.get("start"), span.get("end")
        elif isinstance(span, list | tuple) and len(span) == 3:
            label, start, end = span
        else:
            continue
        if not isinstance(start, int) or not isinstance(end, int):
            continue
        text = str(label)
        step = int(text) if text.isdigit() else start_step
        versions[max(0, start) : min(count, end)] = step
    return versions


def _vllm_sampling(params: SamplingParams) -> dict[str, Any]:
    """vLLM's sampling parameters; non-default ones only, so that other
    OpenAI-compatible servers see no field they might refuse."""
    out: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.stop:
        out["stop"] = list(params.stop)
        out["include_stop_str_in_output"] = True  # as the ids keep the stop token
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        out["ignore_eos"] = True
    if params.seed is not None:
        out["seed"] = params.seed
    return out


def _choices(reply: Any, server: _Server, path: str, n: int) -> list[dict[str, Any]]:
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != n or not all(isinstance(c, dict) for c in choices):
        raise EngineError(f"{server.name}{path} returned {_describe(reply)}, not {n} choices")
    return sorted(choices, key=lambda c: c.get("index", 0))


_FINISH = {"stop": FINISH_STOP, "eos": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


def _generation(
    server: _Server,
    path: str,
    ids: Any,
    logprobs: Any,
    versions: np.ndarray,
    reason: Any,
    raw: dict[str, Any],
) -> Generation:
    if not isinstance(ids, list) or len(logprobs) != len(ids):
        raise EngineError(
            f"{server.name}{path} returned {len(logprobs)} logprobs for "
            f"{len(ids) if isinstance(ids, list) else _describe(ids)} tokens"
        )
    finish = _FINISH.get(str(reason), FINISH_STOP if reason is None else str(reason))
    if finish not in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT):
        raise EngineError(f"{server.name}{path} finished a request with {reason!r}: {_describe(raw)}")
    text = raw.get("text")
    return Generation(
        np.asarray(ids, dtype=ID_DTYPE),
        np.asarray(logprobs, dtype=LOGPROB_DTYPE),
        versions,
        finish,
        text=text if isinstance(text, str) else "",
    )


def _aborted(step: int) -> Generation:
    empty = np.zeros(0, dtype=ID_DTYPE)
    return Generation(empty, np.zeros(0, dtype=LOGPROB_DTYPE), empty, FINISH_ABORT)


def _check_success(reply: Any, server: _Server, path: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineError(f"{server.name}{path} failed: {str(reply.get('message', ''))[:_ERROR_TEXT]}")


def _error_text(response: httpx.Response) -> str:
    """The server's own words: the message of a JSON error (OpenAI's, FastAPI's,
    SGLang's shapes), else the start of the body."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:_ERROR_TEXT] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        for value in (
            error.get("message") if isinstance(error, dict) else error,
            data.get("message"),
            data.get("detail"),
        ):
            if value:
                return str(value)[:_ERROR_TEXT]
    return str(data)[:_ERROR_TEXT]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _without_userinfo(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """The URL without its user info, and that as basic auth: httpx logs request URLs.
    The user info ends at the last '@', as redact_url reads it."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    return f"{scheme}{sep}{host}", httpx.BasicAuth(unquote(user), unquote(password))


def _base_urls(urls: list[str], kind: str) -> list[str]:
    if not urls:
        raise SettingsError(
            f"engines.{kind}.urls is empty: give the base URL of at least one server, "
            'e.g. urls = ["http://127.0.0.1:8000"]'
        )
    out = []
    for url in urls:
        base = url.strip().rstrip("/")
        scheme, sep, rest = base.partition("://")
        if not sep or scheme not in ("http", "https") or not rest or rest.startswith("/"):
            raise SettingsError(
                f"engines.{kind}.urls: {redact_url(url)!r} is not an http:// or https:// URL of a server"
            )
        if base.endswith("/v1"):  # an OpenAI client's base_url: the server's root is above it
            base = base[: -len("/v1")]
        out.append(base)
    if len(set(out)) != len(out):
        raise SettingsError(f"engines.{kind}.urls names a server twice: {[redact_url(u) for u in urls]}")
    return out


def openai_from_settings(settings: EngineSettings) -> OpenAIEngine:
    """The engine of ``engines.kind = "openai"``."""
    return OpenAIEngine(settings.openai)


def sglang_from_settings(settings: EngineSettings) -> SGLangEngine:
    """The engine of ``engines.kind = "sglang"``."""
    return SGLangEngine(settings.sglang)
