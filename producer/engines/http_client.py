"""The HTTP side of the engines on servers the user runs (http.py): one server as an
engine sees it, and talking to it.

``ServerClient`` holds one httpx client per event loop and sends requests whose failures
it sorts in two: a server that does not answer (connection refused or reset, a timeout,
429, 502/503/504) raises ``_Unreachable``, and the engine takes it out; one that answers
with an error raises an EngineError that carries the server's own words. A generation
that outlasts ``timeout_s`` is the exception: its server is busy, not gone, so it is asked
to abort it (``_abort_on``, which each kind implements) and stays in. It finds out
which endpoints a server has (``_paths``), and the helpers below say what a server's
replies mean (token ids, logprobs, finish reasons, per-token weight versions) and where
it finds the trainer's weights. Messages name URLs without passwords and never carry
the api key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
    Generation,
)
from rollstream.shared.engine_settings import HTTPEngineSettings
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ID_DTYPE, LOGPROB_DTYPE
from rollstream.shared.settings_errors import redact_url

logger = logging.getLogger(__name__)

_UNAVAILABLE = (
    429,
    502,
    503,
    504,
)  # overloaded or rate-limited, a proxy without a backend, a server starting
_CONTROL_TIMEOUT_S = 30.0  # capability probes and aborts (a busy server builds its schema slowly)
_ERROR_TEXT = 300  # characters of a server's error reply kept in our messages

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


class ServerClient:
    """Requests to the engine's servers: the client, errors, endpoints, weights paths."""

    kind: ClassVar[str] = "http"

    def __init__(self, settings: HTTPEngineSettings, transport: httpx.AsyncBaseTransport | None) -> None:
        self.settings = settings
        self._transport = transport  # tests put a fake server here
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._warned: set[str] = set()

    async def _abort_on(self, server: _Server, call: _Call) -> bool | None:
        """Ask the server to abort the call: True when asked, False when the server has
        no way to, None when the call has not reached the point of asking yet."""
        raise NotImplementedError

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
