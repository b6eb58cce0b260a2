"""The agent-loop plug-in point: what makes each trajectory of a group.

An agent produces one trajectory per sample of a group, calling the engine as many
times as it needs; the producer judges the group, filters it and writes it as ever.
``producer.agent`` names one: a built-in (``BUILTIN_AGENTS``) or a dotted path
``package.module:attr`` to a class or factory that takes an ``AgentConfig`` and
returns an ``Agent`` (``run_group(rollout, samples)``). ``producer.agent_options``
holds the agent's own options. An agent with resources of its own may also have
``async startup()`` and ``async shutdown()``: the producer calls them before it claims
anything and after its last group settled (the proxy serves HTTP between the two).

- ``single_turn`` (the default): one response per sample (single.py);
- ``multi_turn``: model turns alternating with an environment plug-in's (multi.py);
- ``tool``: the model calls tool plug-ins, their results are the next turns (tools.py);
- ``proxy``: an outside agent plays each trajectory through an OpenAI-compatible
  front door, ``rollstream proxy`` (proxy.py).

Token in, token out (base.py): a trajectory is one token sequence, the model's ids as
sampled and the others' as tokenised once, with a loss mask; the stream carries it
as format 1.1 (docs/stream-format.md). Examples: examples.py, examples/agents/.

Names are imported from their modules on first use, not here: a tool's sandbox
process (sandbox.py) imports a tool from this package (examples.py) and must not pay
for the producer's imports to do it.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Agent": "base",
    "AgentConfig": "base",
    "Rollout": "base",
    "Trajectory": "base",
    "DONE": "base",
    "ENV_ERROR": "base",
    "MAX_TOKENS": "base",
    "MAX_TURNS": "base",
    "TurnText": "text",
    "SingleTurnAgent": "single",
    "TurnLoop": "loop",
    "Environment": "multi",
    "MultiTurnAgent": "multi",
    "ToolAgent": "tools",
    "ProxyAgent": "proxy",
    "ToolCall": "tools",
    "parse_calls": "tools",
    "BUILTIN_AGENTS": "registry",
    "load_agent": "registry",
    "env_return": "rewards",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
