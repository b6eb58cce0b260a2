"""``tool``: the model calls tools, the tools' results come back as the next turns.

Call syntax. A model turn calls a tool by writing JSON in a tag::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

(``arguments`` an object, or a JSON string of one, as OpenAI's API writes it; absent
means none). A model turn stops after ``</tool_call>`` (a stop string, on engines
that have a tokenizer); a turn may hold several calls. A turn without any call is
the model's final answer: the trajectory is done.

Each call's result is a turn of its own (role ``tool``, the tool's name, a status),
its content the JSON ``{"name": ..., "result": ...}`` or ``{"name": ..., "error":
...}`` framed as a message (text.py). Every failure is an answer the model reads
and a status the stream records, never a silent zero:

=============  ===================================================================
status         when
=============  ===================================================================
ok             the tool returned (its result, cut to ``max_result_chars``)
malformed      the call is not JSON, not an object, has no name, its arguments
               are not an object, or a ``<tool_call>`` is never closed
unknown_tool   no tool of that name (the error lists the tools there are)
timeout        the tool ran past ``tool_timeout_s`` (its process is killed)
error          the tool raised, or its process died (the error says how)
=============  ===================================================================

Tools are plug-ins (agent option ``tools``: ``{"name": "package.module:attr"}``),
each a callable taking the call's arguments as keywords and returning anything
JSON can hold (other values are sent as their ``str``). Where they run (``sandbox``):

- ``subprocess`` (the default): a fresh Python process per call
  (sandbox.py), JSON in and out, killed at the timeout. A hung or crashing tool
  costs its process, never the producer; a call costs a process start (about
  0.1 s). The process inherits the producer's environment and import path.
- ``inline``: a thread of the producer; the timeout stops waiting for it but cannot
  stop it. For fast tools that are trusted not to hang.

The tools do not run on the judge's rq queue: a call is a short round trip inside a
trajectory, which rq would make longer (a queue hop both ways, and whole seconds as
its only timeout), and rq's workers serve the judge queue alone.

Options: ``tools`` (required), ``sandbox``, ``tool_timeout_s`` (10), ``max_result_chars``
(2,000), ``tool_role`` ("tool": the role a result is framed as), ``turn_template``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from rollstream.producer.agents.base import DONE, MAX_TOKENS, OPTION_ERROR, AgentConfig, Rollout, Trajectory
from rollstream.producer.agents.loop import COMMON_OPTIONS, TurnLoop
from rollstream.producer.agents.multi import load_factory
from rollstream.producer.agents.text import TurnText
from rollstream.producer.engines.base import Generation
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import TOOL

log = logging.getLogger(__name__)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)

OK, MALFORMED, UNKNOWN_TOOL, TIMEOUT, ERROR = "ok", "malformed", "unknown_tool", "timeout", "error"
SANDBOXES = ("subprocess", "inline")


@dataclass(slots=True)
class ToolCall:
    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call is malformed


@dataclass(slots=True)
class ToolResult:
    status: str
    content: str  # what the model reads


def parse_calls(text: str) -> list[ToolCall]:
    """The tool calls of a model turn, in order; a malformed one is a call with an error."""
    calls = [_parse(body) for body in _CALL.findall(text)]
    if CALL_OPEN in _CALL.sub("", text):
        calls.append(ToolCall(None, error=f"a {CALL_OPEN} without its {CALL_CLOSE}"))
    return calls


def _parse(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, error=f"not JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(data, dict):
        return ToolCall(None, error=f"not a JSON object but {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error='no "name" of the tool')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's API sends the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, error=f'"arguments" is a string that is not JSON ({exc.msg})')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'"arguments" is {type(arguments).__name__}, not an object')
    return ToolCall(name, arguments)


class ToolAgent(TurnLoop):
    name = "tool"
    stop = (CALL_CLOSE,)
    OPTIONS = ("tools", "sandbox", "tool_timeout_s", "max_result_chars", "tool_role", *COMMON_OPTIONS)

    def __init__(self, config: AgentConfig) -> None:
        config.check_options(self.name, self.OPTIONS, required=("tools",))
        super().__init__(config)
        options = config.options
        tools = options["tools"]
        if not isinstance(tools, dict) or not tools:
            raise SettingsError(
                f'{OPTION_ERROR}: tools must be an object {{"name": "package.module:attr"}}, got {tools!r}'
            )
        # imported here as well, so that a tool that cannot be found fails at start-up
        self.functions = {str(name): load_factory(spec, f"tool {name!r}") for name, spec in tools.items()}
        self.specs = {str(name): str(spec) for name, spec in tools.items()}
        self.sandbox = options.get("sandbox", "subprocess")
        if self.sandbox not in SANDBOXES:
            raise SettingsError(
                f"{OPTION_ERROR}: sandbox must be one of {', '.join(SANDBOXES)}, got {self.sandbox!r}"
            )
        self.timeout_s = _positive(options.get("tool_timeout_s", 10.0), "tool_timeout_s")
        self.max_chars = int(_positive(options.get("max_result_chars", 2000), "max_result_chars"))
        self.role = str(options.get("tool_role", "tool"))

    async def respond(
        self,
        rollout: Rollout,
        text: TurnText,
        trajectory: Trajectory,
        state: Any,
        generation: Generation,
        *,
        last: bool,
    ) -> None:
        calls = parse_calls(trajectory.turns[-1].text)
        if not calls:
            trajectory.end(DONE)
            return
        if last:  # no model turn may follow to read the results
            return
        results = await asyncio.gather(*(self.execute(c) for c in calls))
        for call, result in zip(calls, results, strict=True):
            ids, said = text.encode(self.role, result.content)
            if not self.fits(trajectory, ids):
                trajectory.end(MAX_TOKENS)
                return
            trajectory.add_turn(TOOL, ids, said, status=result.status, name=call.name)

    async def execute(self, call: ToolCall) -> ToolResult:
        """A call's result, whatever happens to it."""
        if call.error is not None:
            return self._answer(MALFORMED, call.name, error=f"malformed tool call: {call.error}")
        assert call.name is not None
        if call.name not in self.specs:
            tools = ", ".join(sorted(self.specs))
            return self._answer(
                UNKNOWN_TOOL, call.name, error=f"unknown tool {call.name!r}; the tools are {tools}"
            )
        if self.sandbox == "inline":
            status, value = await self._inline(call)
        else:
            status, value = await self._subprocess(call)
        if status == OK:
            return self._answer(OK, call.name, result=value)
        return self._answer(status, call.name, error=value)

    def _answer(self, status: str, name: str | None, **content: Any) -> ToolResult:
        if "result" in content and not isinstance(content["result"], str):
            content["result"] = json.loads(json.dumps(content["result"], default=str))
        for key in ("result", "error"):
            value = content.get(key)
            if isinstance(value, str) and len(value) > self.max_chars:
                content[key] = value[: self.max_chars] + "..."
        text = json.dumps({"name": name, **content}, ensure_ascii=False, default=str)
        if len(text) > self.max_chars + 200:  # a result of many small values: cut the JSON itself
            text = text[: self.max_chars] + "..."
        return ToolResult(status, text)

    async def _inline(self, call: ToolCall) -> tuple[str, Any]:
        function = self.functions[call.name]  # type: ignore[index]
        try:
            async with asyncio.timeout(self.timeout_s):
                return OK, await asyncio.to_thread(function, **call.arguments)
        except TimeoutError:
            return TIMEOUT, f"tool {call.name!r} timed out after {self.timeout_s:g} s"
        except Exception as exc:
            return ERROR, f"tool {call.name!r} failed: {type(exc).__name__}: {exc}"

    async def _subprocess(self, call: ToolCall) -> tuple[str, Any]:
        request = json.dumps({"tool": self.specs[call.name], "arguments": call.arguments}).encode()  # type: ignore[index]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollstream.producer.agents.sandbox",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                out, err = await process.communicate(request)
        except TimeoutError:
            return TIMEOUT, f"tool {call.name!r} timed out after {self.timeout_s:g} s"
        finally:
            if process.returncode is None:  # timed out, or the trajectory was cancelled
                process.kill()
                await process.wait()
        try:
            reply = json.loads(out)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not ({"result", "error"} & set(reply)):
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            return (
                ERROR,
                f"tool {call.name!r} failed: its process exited with code {process.returncode}: {tail[0]}",
            )
        if "error" in reply:
            return ERROR, f"tool {call.name!r} failed: {reply['error']}"
        return OK, reply["result"]


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SettingsError(f"{OPTION_ERROR}: {name} must be a number above 0, got {value!r}")
    return float(value)
