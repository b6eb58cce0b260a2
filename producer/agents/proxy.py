"""``proxy``: the trajectories are an outside agent's, played through an OpenAI-compatible
front door (``rollstream proxy``; AReaL's "online" mode). Any agent written against the
OpenAI client trains through rollstream: it asks the proxy for an episode, talks to the
run's engines through the episode's ``base_url`` as it would to any server, and reports
the episode's reward; the proxy records every call's token ids, logprobs and versions
and writes the trajectory as one sample of its group.

The producer claims prompts as ever (admission, staleness, fenced settles): each sample
of a claimed group is an episode an agent can take. The HTTP API (aiohttp, extra
``proxy``)::

    POST /episodes                          {"wait_s": 30}  -> 200 an episode, 204 none yet
    POST /episodes/{id}/v1/chat/completions  OpenAI chat, n = 1
    POST /episodes/{id}/v1/completions       OpenAI completions (text or token ids), n = 1
    POST /episodes/{id}/reward               {"reward": 1.0} -> the episode ends
    GET  /health

An episode is ``{"episode_id", "base_url", "group_id", "uid", "task", "prompt", "meta"}``
(``prompt``: the text or chat messages as fed). Token in, token out: an episode is one
trajectory. Its first call's prompt is tokenised as the producer tokenises prompts;
each later call must continue the conversation so far (the earlier messages and the
model's replies as the proxy returned them; for completions, the earlier prompt and
completion text, or token ids that start with the trajectory's), and only what it adds
is tokenised, once, as an environment turn (``tool`` when every added message is a
tool result) framed as producer/agents/text.py frames turns. The model's tokens stay
exactly as sampled. A call that rewrites the history is refused (409), never
re-tokenised.

The reward lands on the last model turn (``Turn.reward``): judge the groups with
``env_return`` (``rollstream proxy`` does). Sampling is the run's
(``producer.temperature`` / ``top_p``): a call's own temperature is ignored, so the
recorded logprobs are the behaviour policy's. ``max_tokens`` is capped at
``producer.max_tokens``; ``producer.max_turns`` and ``max_trajectory_tokens`` bound an
episode.

An episode ends without a trajectory (its group goes back to the aborted pool with
nothing kept, for other episodes to make again) when a weight sync in abort mode, a
pause or a stop reaches its group (its calls then answer 409 ``episode_aborted``), or
when no reward came within ``episode_timeout_s``. An outside agent's state cannot be
resumed, so partial mode keeps nothing of a proxy episode.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollstream.producer.agents.base import DONE, OPTION_ERROR, AgentConfig, Rollout, Trajectory
from rollstream.producer.engines.base import FINISH_ABORT, FINISH_LENGTH
from rollstream.producer.tokenizer import BytesTokenizer, HFTokenizer, Tokenizer
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ENV, MODEL, TOOL, Sample, Status

log = logging.getLogger(__name__)

OPTIONS = ("host", "port", "public_url", "episode_timeout_s")
DEFAULT_PORT = 8642
SHUTDOWN_S = 5.0  # how long a stopping proxy lets the calls in progress finish
ABORTED_EPISODE = "episode_aborted"


class ProxyError(Exception):
    """A call the proxy refuses: its HTTP status and an OpenAI-style error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass(eq=False)
class Episode:
    id: str  # URL-safe: it is a path segment of the episode's base_url
    number: int  # the proxy's count: the episode's part of its engine request ids
    rollout: Rollout
    created: float
    trajectory: Trajectory | None = None
    style: str = ""  # "chat" or "completions", fixed by the first call
    messages: list[tuple[str, str]] = field(default_factory=list)  # chat: the history so far
    text: str = ""  # completions with text prompts: the prompt and completions so far
    reward: float | None = None
    aborted: str = ""  # why, once it is
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def abort(self, why: str) -> None:
        if not self.ended.is_set():
            self.aborted = why
            self.ended.set()


class ProxyAgent:
    """The agent of ``rollstream proxy``: each sample of a group is an episode that an
    outside agent plays over HTTP (see the module docstring)."""

    def __init__(self, config: AgentConfig) -> None:
        config.check_options("proxy", OPTIONS)
        self.config = config
        options = config.options
        self.host = str(options.get("host", "127.0.0.1"))
        port = _option(options, "port", DEFAULT_PORT, 0, 65535)
        if not port.is_integer():
            raise SettingsError(
                f"{OPTION_ERROR}: the proxy's port must be an integer, got {options['port']!r}"
            )
        self.port = int(port)
        self.public_url = str(options.get("public_url", "")).rstrip("/")
        self.episode_timeout_s = _option(options, "episode_timeout_s", 600.0, 0.001, math.inf)
        self.waiting: asyncio.Queue[Episode] = asyncio.Queue()
        self.episodes: dict[str, Episode] = {}
        self._ids = itertools.count(1)
        self._runner: Any = None
        self._closing = asyncio.Event()  # set by shutdown: the agents waiting for an episode get 204
        self.url = ""

    # --- the producer's side -----------------------------------------------------------

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

    async def run_group(self, rollout: Rollout, samples: list[Sample]) -> list[Sample]:
        episodes = [self._open(rollout) for _ in samples]
        try:
            deadline = time.monotonic() + self.episode_timeout_s
            while not all(e.ended.is_set() for e in episodes):
                if rollout.aborting:  # a pause or a stop: no episode of the group goes on
                    for e in episodes:
                        e.abort("the group was aborted (a pause, a stop or a weight sync)")
                    break
                if time.monotonic() > deadline:
                    log.warning(
                        "proxy: group %s had no reward from %d of its %d episodes within %.0f s: "
                        "it goes back to be made again", rollout.prompt.group_id,
                        sum(not e.ended.is_set() for e in episodes), len(episodes), self.episode_timeout_s,
                    )  # fmt: skip
                    for e in episodes:
                        e.abort(f"no reward within {self.episode_timeout_s:.0f} s")
                    break
                await _first_set(
                    [rollout.aborted, *(e.ended for e in episodes)], timeout=deadline - time.monotonic()
                )
        finally:
            for e in episodes:
                e.abort("the producer stops")
                self.episodes.pop(e.id, None)
            self._unqueue(episodes)
        if any(e.aborted for e in episodes):
            rollout.aborting = True
            return [_nothing_kept(s) for s in samples]
        return [self._sample(e) for e in episodes]

    def _open(self, rollout: Rollout) -> Episode:
        number = next(self._ids)
        episode = Episode(f"{number}-{secrets.token_hex(6)}", number, rollout, time.monotonic())
        self.episodes[episode.id] = episode
        self.waiting.put_nowait(episode)
        return episode

    def _unqueue(self, ended: list[Episode]) -> None:
        """Drop ended episodes from those waiting to be taken: when no agent polls, each
        group that times out would leave its episodes there, each holding its rollout."""
        gone, kept = set(ended), []
        while not self.waiting.empty():
            episode = self.waiting.get_nowait()
            if episode not in gone:
                kept.append(episode)
        for episode in kept:
            self.waiting.put_nowait(episode)

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

    def _sample(self, episode: Episode) -> Sample:
        trajectory = episode.trajectory
        assert trajectory is not None and episode.reward is not None  # a reward needs a model turn
        last_model = next(t for t in reversed(trajectory.turns) if t.role == MODEL)
        last_model.reward = episode.reward
        trajectory.end(DONE)
        return trajectory.to_sample()

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
                _live(episode)  # the call or reward before this one may have ended it
                return _json(await self._generate(episode, body, style))
        except ProxyError as exc:
            return _error(exc)

    async def _reward(self, request: Any) -> Any:
        try:
            episode = self._episode(request)
            body = await _body(request)
            reward = _number(body.get("reward"), "reward", -math.inf, math.inf)
            async with episode.lock:
                _live(episode)  # a call before this one may have been aborted
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
        return _live(episode)

    # --- one call ----------------------------------------------------------------------

    async def _generate(self, episode: Episode, body: dict[str, Any], style: str) -> dict[str, Any]:
        if episode.style and episode.style != style:
            raise ProxyError(400, f"episode {episode.id} is a {episode.style} episode: keep to one endpoint")
        n = body.get("n", 1)
        if n != 1:
            raise ProxyError(
                400, f"n must be 1 (an episode is one trajectory; the group has n episodes), got {n!r}"
            )
        rollout, config = episode.rollout, self.config
        tokenizer = Turns(rollout.tokenizer)
        history: list[tuple[str, str]] = []
        if style == "chat":
            history = _messages(body.get("messages"))
            added, role, text = self._chat_turn(episode, tokenizer, history)
        else:
            added, role, text = self._completion_turn(episode, tokenizer, body.get("prompt"))
        # nothing changes before the call is known good: a refused or failed call leaves the
        # episode as it was, so that the agent's retry adds its turn once
        trajectory, turn_ids = episode.trajectory, added
        if trajectory is None:
            trajectory, turn_ids = Trajectory(added), []
        if trajectory.model_turns >= config.max_turns:
            raise ProxyError(
                400, f"episode {episode.id} has had its {config.max_turns} model turns (producer.max_turns)"
            )
        max_tokens = min(_max_tokens(body, config.max_tokens), config.max_tokens)
        if config.max_trajectory_tokens:
            max_tokens = min(max_tokens, config.max_trajectory_tokens - trajectory.length - len(turn_ids))
            if max_tokens <= 0:
                raise ProxyError(400, f"episode {episode.id} has spent producer.max_trajectory_tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ProxyError(400, "stop must be a string or a list of strings")
        key = f"/{episode.number}.{trajectory.model_turns}"
        (generation,) = await rollout.generate(trajectory.context() + turn_ids, 1, max_tokens, key, stop)
        if generation.finish_reason == FINISH_ABORT or episode.aborted:
            for other in self.episodes.values():  # the whole group goes back: none of it goes on
                if other.rollout is rollout:
                    other.abort("its group was aborted (a weight sync in abort mode, a pause or a stop)")
            raise ProxyError(409, f"episode {episode.id} was aborted: {episode.aborted}", ABORTED_EPISODE)
        # committed only now: a refused or aborted call leaves the episode as it was
        episode.trajectory = trajectory
        episode.style = style
        if turn_ids:
            trajectory.add_turn(role, turn_ids, text)
        trajectory.add_model(generation)
        if style == "chat":
            episode.messages = [*history, ("assistant", generation.text)]
        elif isinstance(body.get("prompt"), str):
            episode.text = body["prompt"] + generation.text
        finish = "length" if generation.finish_reason == FINISH_LENGTH else "stop"
        prompt_tokens, completion_tokens = (
            len(trajectory.context()) - len(generation.response_ids),
            len(generation.response_ids),
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        turn = trajectory.model_turns
        common = {"created": int(time.time()), "model": str(body.get("model", "rollstream")), "usage": usage}
        if style == "chat":
            message = {"role": "assistant", "content": generation.text}
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            return {
                "id": f"chatcmpl-{episode.id}-{turn}",
                "object": "chat.completion",
                "choices": [choice],
                **common,
            }
        choice = {"index": 0, "text": generation.text, "finish_reason": finish, "logprobs": None}
        return {"id": f"cmpl-{episode.id}-{turn}", "object": "text_completion", "choices": [choice], **common}

    def _chat_turn(
        self, episode: Episode, tokenizer: Turns, history: list[tuple[str, str]]
    ) -> tuple[list[int], str, str]:
        """(ids, role, text) of what the call's messages add to the episode: the whole
        prompt at the first call; after that, the messages after the history, as one
        turn that is not the model's."""
        if episode.trajectory is None:
            return tokenizer.prompt([{"role": r, "content": c} for r, c in history]), "", ""
        seen = episode.messages
        if history[: len(seen)] != seen:
            where = next(
                (i for i, (a, b) in enumerate(zip(history, seen, strict=False)) if a != b), len(history)
            )
            raise ProxyError(
                409,
                f"the messages do not continue episode {episode.id}: message {where} differs from the "
                "conversation so far (send every earlier message, and the model's replies as returned)",
                "history_mismatch",
            )
        added = history[len(seen) :]
        if not added:
            return [], "", ""
        if any(role == "assistant" for role, _ in added):
            raise ProxyError(
                400, "assistant messages come from the model: send only the messages that answer it"
            )
        role = TOOL if all(r == "tool" for r, _ in added) else ENV
        ids, text = tokenizer.turn(added)
        return ids, role, text

    def _completion_turn(self, episode: Episode, tokenizer: Turns, prompt: Any) -> tuple[list[int], str, str]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # the client's batch of one
        if isinstance(prompt, str):
            if episode.trajectory is None:
                return tokenizer.encode_prompt(prompt), "", ""
            if not episode.text or not prompt.startswith(episode.text):
                raise ProxyError(
                    409,
                    f"the prompt does not continue episode {episode.id}: send the earlier prompt and "
                    "completion text as they were, then what answers them",
                    "history_mismatch",
                )
            added = prompt[len(episode.text) :]
            return (tokenizer.encode_text(added), ENV, added) if added else ([], "", "")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            if episode.trajectory is None:
                return list(prompt), "", ""
            context = episode.trajectory.context()
            if prompt[: len(context)] != context:
                raise ProxyError(
                    409,
                    f"the token ids do not continue episode {episode.id}: they must start with the "
                    "trajectory's (the earlier prompt ids and completion ids)",
                    "history_mismatch",
                )
            added_ids = prompt[len(context) :]
            return added_ids, ENV, tokenizer.decode(added_ids)
        raise ProxyError(400, "prompt must be a string or a list of token ids")


class Turns:
    """Text to ids for the proxy, as the producer and the multi-turn agents do it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from rollstream.producer.agents.text import TurnText

        self.tokenizer = tokenizer
        self._hf: Any = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else None
        self._turn_text = TurnText(tokenizer, [{"role": "user", "content": ""}])

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.encode(messages))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_text(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, BytesTokenizer):
            return list(text.encode("utf-8"))
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(self.tokenizer, BytesTokenizer):
            return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")
        if self._hf is not None:
            return str(self._hf.decode(list(ids)))
        return ""

    def turn(self, messages: list[tuple[str, str]]) -> tuple[list[int], str]:
        """Messages that answer the model, framed as the multi-turn agents frame a turn."""
        try:
            text = self._turn_text.render_many(messages)
        except ValueError as exc:
            raise ProxyError(400, str(exc)) from None
        return self.encode_text(text), text


def _option(options: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A numeric option of the proxy, or a SettingsError naming it and its range."""
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise SettingsError(
            f"{OPTION_ERROR}: the proxy's {name} must be a number in [{low}, {high}], got {value!r}"
        )
    return float(value)


def _live(episode: Episode) -> Episode:
    """The episode, or a 409 when it is over (aborted, or its reward is in)."""
    if episode.aborted:
        raise ProxyError(409, f"episode {episode.id} was aborted: {episode.aborted}", ABORTED_EPISODE)
    if episode.ended.is_set():
        raise ProxyError(409, f"episode {episode.id} has its reward already: it is over", "episode_over")
    return episode


def _messages(messages: Any) -> list[tuple[str, str]]:
    """(role, content) of each chat message; content parts of text are joined."""
    if not isinstance(messages, list) or not messages:
        raise ProxyError(400, "messages must be a non-empty list")
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ProxyError(400, f"messages[{i}] must be an object with a role")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ProxyError(400, f"messages[{i}].content: only text parts are served")
            content = "".join(texts)  # type: ignore[arg-type]
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ProxyError(400, f"messages[{i}].content must be a string or a list of text parts")
        if message.get("tool_calls"):
            raise ProxyError(
                400, f"messages[{i}]: tool_calls are not served; the model writes its calls as text"
            )
        out.append((message["role"], content))
    return out


def _max_tokens(body: dict[str, Any], default: int) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return default
    if type(value) is not int or value < 1:
        raise ProxyError(400, f"max_tokens must be a positive integer, got {value!r}")
    return int(value)


def _number(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ProxyError(400, f"{name} must be a number in [{low}, {high}], got {value!r}")
    if not math.isfinite(value):
        raise ProxyError(400, f"{name} must be finite, got {value!r}")
    return float(value)


def _nothing_kept(sample: Sample) -> Sample:
    """The sample handed back as it came, aborted: an outside agent cannot resume it."""
    return Sample(sample.prompt_ids, [], [], [], status=Status.ABORTED, finish_reason=FINISH_ABORT)


async def _first_set(events: list[asyncio.Event], timeout: float) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events if not e.is_set()]
    if not waiters:
        return
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


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
