"""The proxy agent's HTTP API (producer/agents/proxy.py draws it): the aiohttp server, its
routes, and the episodes handed to the agents that poll for them. ProxyServer is the
half of ProxyAgent that serves; the other half opens the episodes and waits for them."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import orjson

from rollstream.producer.agents.base import OPTION_ERROR, AgentConfig
from rollstream.producer.agents.proxy_episode import Episode, ProxyError, generate, live
from rollstream.shared.errors import SettingsError

log = logging.getLogger(__name__)

SHUTDOWN_S = 5.0  # how long a stopping proxy lets the calls in progress finish


class ProxyServer:
    """Serves the HTTP API over the episodes of the ProxyAgent it is part of: its table
    ``episodes`` and its queue ``waiting`` of episodes no agent has taken yet."""

    config: AgentConfig
    host: str
    port: int
    public_url: str
    url: str
    episodes: dict[str, Episode]
    waiting: asyncio.Queue[Episode]
    _runner: Any
    _closing: asyncio.Event  # set by shutdown: the agents waiting for an episode get 204

    async def startup(self) -> None:
        """Serve the HTTP API (the producer calls this before it claims anything)."""
        try:
            from aiohttp import web
        except ImportError:
            raise RuntimeError("the proxy agent needs aiohttp: pip install 'rollstream[proxy]'") from None
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            [
                web.get("/health", self._health),
                web.post("/episodes", self._take),
                web.post("/episodes/{id}/v1/chat/completions", self._chat),
                web.post("/episodes/{id}/v1/completions", self._completions),
                web.post("/episodes/{id}/reward", self._reward),
            ]
        )
        self._closing.clear()
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_S)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as exc:  # the port is in use, the host is not this machine's
            await self._runner.cleanup()
            self._runner = None
            raise SettingsError(
                f"{OPTION_ERROR}: the proxy cannot serve on {self.host}:{self.port}: {exc.strerror or exc} "
                "(set the proxy's host and port; port 0 takes a free one)"
            ) from exc
        port = self._runner.addresses[0][1]
        self.url = self.public_url or f"http://{self.host}:{port}"
        log.info("proxy serves episodes on %s (POST /episodes)", self.url)

    async def shutdown(self) -> None:
        self._closing.set()
        for episode in self.episodes.values():
            episode.abort("the producer stops")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _next(self, timeout: float) -> Episode | None:
        """The next episode waiting to be taken, or None after ``timeout`` s (0: only one
        already waiting) or once the proxy stops."""
        try:
            return self.waiting.get_nowait()
        except asyncio.QueueEmpty:
            if timeout <= 0 or self._closing.is_set():
                return None
        get, closing = asyncio.ensure_future(self.waiting.get()), asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait((get, closing), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            get.cancel()  # a get cancelled before it took its episode leaves it in the queue
        return get.result() if get.done() and not get.cancelled() else None

    # --- HTTP --------------------------------------------------------------------------

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok", "open_episodes": self.waiting.qsize()})

    async def _take(self, request: Any) -> Any:
        from aiohttp import web

        body = await _body(request, optional=True)
        wait_s = _number(body.get("wait_s", 30.0), "wait_s", 0.0, 3600.0)
        deadline = time.monotonic() + wait_s
        while True:
            episode = await self._next(deadline - time.monotonic())
            if episode is None:
                return web.Response(status=204)
            if not episode.ended.is_set():  # an episode whose group went away is skipped
                break
        prompt = episode.rollout.prompt
        return _json(
            {
                "episode_id": episode.id,
                "base_url": f"{self.url}/episodes/{episode.id}/v1",
                "group_id": prompt.group_id,
                "uid": prompt.uid,
                "task": prompt.task,
                "prompt": prompt.prompt,
                "meta": prompt.meta,
            }
        )

    async def _chat(self, request: Any) -> Any:
        return await self._call(request, "chat")

    async def _completions(self, request: Any) -> Any:
        return await self._call(request, "completions")

    async def _call(self, request: Any, style: str) -> Any:
        try:
            episode = self._episode(request)
            body = await _body(request)
            async with episode.lock:  # one call at a time: each continues the one before
                live(episode)  # the call or reward before this one may have ended it
                return _json(await generate(self.config, self.episodes, episode, body, style))
        except ProxyError as exc:
            return _error(exc)

    async def _reward(self, request: Any) -> Any:
        try:
            episode = self._episode(request)
            body = await _body(request)
            reward = _number(body.get("reward"), "reward", -math.inf, math.inf)
            async with episode.lock:
                live(episode)  # a call before this one may have been aborted
                if episode.trajectory is None or episode.trajectory.model_turns == 0:
                    raise ProxyError(400, f"episode {episode.id} has no model turn to reward")
                episode.reward = reward
                episode.ended.set()
        except ProxyError as exc:
            return _error(exc)
        return _json({"episode_id": episode.id, "reward": reward, "turns": len(episode.trajectory.turns)})

    def _episode(self, request: Any) -> Episode:
        episode_id = request.match_info["id"]
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise ProxyError(404, f"no open episode {episode_id!r} (it ended, or never was)", "not_found")
        return live(episode)


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ProxyError(400, f"{name} must be a number in [{low}, {high}], got {value!r}")
    if not math.isfinite(value):
        raise ProxyError(400, f"{name} must be finite, got {value!r}")
    return float(value)


async def _body(request: Any, *, optional: bool = False) -> dict[str, Any]:
    raw = await request.read()
    if not raw and optional:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProxyError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "the body must be a JSON object")
    return body


def _json(payload: dict[str, Any]) -> Any:
    from aiohttp import web

    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _error(exc: ProxyError) -> Any:
    from aiohttp import web

    payload = {"error": {"message": str(exc), "type": exc.kind, "code": exc.status}}
    return web.Response(status=exc.status, body=orjson.dumps(payload), content_type="application/json")
