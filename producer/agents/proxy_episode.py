"""An episode of the proxy agent (producer/agents/proxy.py) and what each OpenAI call adds
to it: the call checked against the conversation so far, what it adds tokenised once as
an environment turn, the model's turn generated and recorded as sampled, and the reply
in OpenAI's form. A call that does not continue the episode is a ProxyError (the HTTP
status and an OpenAI-style error type), never re-tokenised."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollstream.producer.agents.base import AgentConfig, Rollout, Trajectory
from rollstream.producer.engines.base import FINISH_ABORT, FINISH_LENGTH
from rollstream.producer.tokenizer import BytesTokenizer, HFTokenizer, Tokenizer
from rollstream.shared.records import ENV, TOOL

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


async def generate(
    config: AgentConfig, episodes: Mapping[str, Episode], episode: Episode, body: dict[str, Any], style: str
) -> dict[str, Any]:
    """One call of ``episode`` (of ``style``: "chat" or "completions") with its JSON
    ``body``: the OpenAI reply. ``episodes``: the proxy's open ones, of which those of
    the same group are aborted with it."""
    if episode.style and episode.style != style:
        raise ProxyError(400, f"episode {episode.id} is a {episode.style} episode: keep to one endpoint")
    n = body.get("n", 1)
    if n != 1:
        raise ProxyError(
            400, f"n must be 1 (an episode is one trajectory; the group has n episodes), got {n!r}"
        )
    rollout = episode.rollout
    tokenizer = Turns(rollout.tokenizer)
    history: list[tuple[str, str]] = []
    if style == "chat":
        history = _messages(body.get("messages"))
        added, role, text = _chat_turn(episode, tokenizer, history)
    else:
        added, role, text = _completion_turn(episode, tokenizer, body.get("prompt"))
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
        for other in episodes.values():  # the whole group goes back: none of it goes on
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
    episode: Episode, tokenizer: Turns, history: list[tuple[str, str]]
) -> tuple[list[int], str, str]:
    """(ids, role, text) of what the call's messages add to the episode: the whole
    prompt at the first call; after that, the messages after the history, as one
    turn that is not the model's."""
    if episode.trajectory is None:
        return tokenizer.prompt([{"role": r, "content": c} for r, c in history]), "", ""
    seen = episode.messages
    if history[: len(seen)] != seen:
        where = next((i for i, (a, b) in enumerate(zip(history, seen, strict=False)) if a != b), len(history))
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
        raise ProxyError(400, "assistant messages come from the model: send only the messages that answer it")
    role = TOOL if all(r == "tool" for r, _ in added) else ENV
    ids, text = tokenizer.turn(added)
    return ids, role, text


def _completion_turn(episode: Episode, tokenizer: Turns, prompt: Any) -> tuple[list[int], str, str]:
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


def live(episode: Episode) -> Episode:
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
