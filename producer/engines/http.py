"""Engines on servers the user runs, reached over HTTP: what every server kind shares.

Two kinds build on ``HTTPEngine``, each in a module of its own: ``openai`` (an
OpenAI-compatible server, vLLM's first of all; openai.py) and ``sglang`` (SGLang's
native API; sglang.py). RL needs token ids in and token ids, logprobs and per-token
model steps out, plus abort, pause and weight loading: more than the OpenAI API says.
So each engine finds out once per server what that server has (``_paths``), and uses
the best of it; an operation the server lacks fails with an EngineError that names what
is missing and what to do instead.

Per-token model steps come from the server's weight-version spans when it returns
them (the engine labels each weight version with its model step); without spans,
every token carries the step the engine held when the request started — the oldest
it can be, which is the safe side for staleness.

Several servers per engine: a request goes to the one with the fewest requests
outstanding from this engine. A server that does not answer (connection refused or
reset, timeout, 429, 502/503/504) is taken out for ``retry_s`` and the request goes to
the next one; when it comes back it is brought to the engine's current weights before
it serves. When every server is out, the EngineError names them all. Messages name
URLs without passwords and never carry the api key.

This module is the engine over its servers; talking to one of them (the requests and
their failures, endpoint discovery, what the replies mean) is http_client.py's
``ServerClient``, which ``HTTPEngine`` extends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import ClassVar

import httpx

from rollstream.producer.engines.base import EngineError, EngineHealth, Generation, SamplingParams
from rollstream.producer.engines.http_client import (
    ServerClient,
    _aborted,
    _base_urls,
    _Call,
    _Server,
    _Unreachable,
    _without_userinfo,
)
from rollstream.shared.engine_settings import HTTPEngineSettings
from rollstream.shared.settings_errors import redact_url

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 2.0  # a health probe of a server that was out (health answers within 5 s)
_ABORT_RETRY_S = 0.25  # an abort can reach a server before the request does: send it again
_ABORT_TRIES = 40
_now = time.monotonic  # the clock of take-outs and busy time (tests move their own)


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


class HTTPEngine(ServerClient):
    """What both kinds share: servers, load balancing, take-out and retry, errors."""

    alive_path: ClassVar[str] = "/health"  # a cheap GET that answers when the server is up

    def __init__(
        self,
        settings: HTTPEngineSettings,
        model_step: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(settings, transport)
        self.model_step = model_step
        self.paused = False
        self._servers: list[_Server] = []
        for i, url in enumerate(_base_urls(settings.urls, self.kind)):
            base, auth = _without_userinfo(url)
            self._servers.append(_Server(base, redact_url(url), i, step=model_step, auth=auth))
        self._tag = uuid.uuid4().hex[:8]  # server-side ids of two engines sharing a server never collide
        self._calls: dict[str, _Call] = {}
        self._path: str | None = None  # the weights of model_step, once the engine loaded any
        self._weights = asyncio.Lock()  # one weight load at a time, updates and re-syncs alike
        self._paused_on: list[_Server] = []
        self._busy = _Busy()
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

    # --- what each kind implements (and _abort_on, which ServerClient declares) -------

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
