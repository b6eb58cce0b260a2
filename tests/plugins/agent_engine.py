"""A plug-in engine that plays the agents' examples: ``engines.kind =
"tests.plugins.agent_engine:make"``, with the byte tokenizer (its tokens are the UTF-8
bytes of what it says, so that its text and ids agree, as a real model's do).

It reads the context it is given as text and answers like a model that knows the game:

- guess-the-number (a prompt "... What is a + b?"): turn t guesses a + b - 2 + t, so
  the third guess is right;
- the calculator task (a prompt that names the calculator): it calls the tool for
  a + b, and once a result came back answers it boxed. A prompt that ends in a tag
  calls it wrong on purpose: ``[unknown]`` a tool that does not exist, ``[malformed]``
  a call that is not JSON, ``[slow]`` the test's tool that sleeps, ``[crash]`` the
  test's tool whose process dies.

``options.hold_turn`` = t: the first request for turn t says half its tokens, then
waits until the test sets ``release`` (or the request is aborted), then says the
rest on the weights it holds by then: a weight sync can land in the middle of it.
``options.fail_turn`` = t: requests for turn t fail (EngineError) while the class's
``failures`` budget lasts, whichever engine gets them.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import ClassVar

from rollstream.producer.engines import (
    FINISH_ABORT,
    FINISH_STOP,
    EngineError,
    EngineHealth,
    EngineSettings,
    Generation,
    SamplingParams,
)

_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")
_RESULT = re.compile(r'"result": (-?\d+)')


def reply(context: str) -> str:
    """What the model says next, given everything so far."""
    a, b = (int(x) for x in _SUM.findall(context)[0])
    if "calculator" not in context:
        turn = context.count("\nuser: ")
        return f"My guess is \\boxed{{{a + b - 2 + turn}}}"
    if "\ntool: " in context:
        results = _RESULT.findall(context)
        return f"The answer is \\boxed{{{results[-1] if results else 0}}}"
    name, arguments = "calculator", {"expression": f"{a} + {b}"}
    if "[unknown]" in context:
        name = "abacus"
    elif "[malformed]" in context:
        return "<tool_call>{calculator: " + f"{a} + {b}" + "}</tool_call>"
    elif "[slow]" in context:
        name, arguments = "slow", {"seconds": 30}
    elif "[crash]" in context:
        name, arguments = "die", {}
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class AgentEngine:
    made: ClassVar[list[AgentEngine]] = []
    failures: ClassVar[int] = 0

    def __init__(self, hold_turn: int = -1, fail_turn: int = -1) -> None:
        self.hold_turn = hold_turn
        self.fail_turn = fail_turn
        self.aborted: list[str] = []  # the ids abort was asked for
        self.step = 0
        self.paused = False
        self.release = asyncio.Event()
        self.holding = asyncio.Event()  # set while a held request waits
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborts: dict[str, asyncio.Event] = {}
        self.requests: list[tuple[str | None, str]] = []  # (request id, the context's text)
        AgentEngine.made.append(self)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> list[Generation]:
        context = bytes(prompt_ids).decode("utf-8")
        self.requests.append((request_id, context))
        text = reply(context)
        ids = list(text.encode())[: params.max_tokens]
        aborted = self._aborts[request_id or ""] = asyncio.Event()
        try:
            await asyncio.sleep(0)  # a real engine awaits its scheduler here
            turn = context.count("\nuser: ") + context.count("\ntool: ")
            if turn == self.fail_turn and AgentEngine.failures > 0:
                AgentEngine.failures -= 1
                raise EngineError(f"agent engine: turn {turn} failed on purpose")
            if turn == self.hold_turn:
                self.hold_turn = -1  # once
                half = len(ids) // 2
                head = [self.step] * half
                self.holding.set()
                waits = [asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(aborted.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for wait in waits:
                    wait.cancel()
                self.holding.clear()
                if aborted.is_set():
                    return [Generation(ids[:half], [-0.1] * half, head, FINISH_ABORT) for _ in range(n)]
                await self._resumed.wait()
                versions = head + [self.step] * (len(ids) - half)
            else:
                if aborted.is_set():
                    return [Generation([], [], [], FINISH_ABORT) for _ in range(n)]
                await self._resumed.wait()
                versions = [self.step] * len(ids)
            return [Generation(ids, [-0.1] * len(ids), versions, FINISH_STOP, text) for _ in range(n)]
        finally:
            self._aborts.pop(request_id or "", None)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        self.aborted.extend(request_ids or [])
        ids = list(self._aborts) if request_ids is None else [r for r in request_ids if r in self._aborts]
        for request_id in ids:
            self._aborts[request_id].set()
        return len(ids)

    async def pause(self) -> None:
        self.paused = True
        self._resumed.clear()

    async def resume(self) -> None:
        self.paused = False
        self._resumed.set()

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        self.step = model_step

    async def health(self) -> EngineHealth:
        return EngineHealth(
            healthy=True,
            model_step=self.step,
            paused=self.paused,
            outstanding=len(self._aborts),
            running=len(self._aborts),
            queued=0,
            busy_fraction=0.0,
            detail="agent engine",
        )


def make(settings: EngineSettings) -> AgentEngine:
    return AgentEngine(**settings.options)
