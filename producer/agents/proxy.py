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

This module opens a group's episodes and waits for their rewards; the HTTP server that
hands them out is producer/agents/proxy_http.py, and what each call adds to an episode
producer/agents/proxy_episode.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from typing import Any

from rollstream.producer.agents.base import DONE, OPTION_ERROR, AgentConfig, Rollout
from rollstream.producer.agents.proxy_episode import Episode
from rollstream.producer.agents.proxy_http import ProxyServer
from rollstream.producer.engines.base import FINISH_ABORT
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import MODEL, Sample, Status

__all__ = [
    "DEFAULT_PORT",
    "OPTIONS",
    "ProxyAgent",
]

log = logging.getLogger(__name__)

OPTIONS = ("host", "port", "public_url", "episode_timeout_s")
DEFAULT_PORT = 8642


class ProxyAgent(ProxyServer):
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

    def _sample(self, episode: Episode) -> Sample:
        trajectory = episode.trajectory
        assert trajectory is not None and episode.reward is not None  # a reward needs a model turn
        last_model = next(t for t in reversed(trajectory.turns) if t.role == MODEL)
        last_model.reward = episode.reward
        trajectory.end(DONE)
        return trajectory.to_sample()


def _option(options: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A numeric option of the proxy, or a SettingsError naming it and its range."""
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise SettingsError(
            f"{OPTION_ERROR}: the proxy's {name} must be a number in [{low}, {high}], got {value!r}"
        )
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
