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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
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
from rollstream.shared.settings import HTTPEngineSettings, redact_url

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

FROM_DISK = "/update_weights_from_disk"  # SGLang's (an OpenAI-kind server may have it too)


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


# The openai and sglang engines lived in this module: their names still import from here.
_MOVED = {
    "OpenAIEngine": "openai",
    "openai_from_settings": "openai",
    "ties_lm_head": "openai",
    "TOKENS": "openai",
    "COMPLETIONS": "openai",
    "TOKENS_ABORT": "openai",
    "DEV_ABORT": "openai",
    "PAUSE": "openai",
    "RESUME": "openai",
    "RPC": "openai",
    "WEIGHT_VERSION": "openai",
    "WORKER_EXTENSION": "openai",
    "RELOAD_METHOD": "openai",
    "SGLangEngine": "sglang",
    "sglang_from_settings": "sglang",
}


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"rollstream.producer.engines.{home}"), name)
