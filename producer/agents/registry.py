"""Agents by name: a built-in (``BUILTIN_AGENTS``) or a dotted path, as the setting
``producer.agent`` gives it, built from an AgentConfig (the producer's budgets and
``producer.agent_options``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from rollstream.producer.agents.base import Agent, AgentConfig
from rollstream.producer.agents.multi import MultiTurnAgent
from rollstream.producer.agents.proxy import ProxyAgent
from rollstream.producer.agents.single import SingleTurnAgent
from rollstream.producer.agents.tools import ToolAgent
from rollstream.producer.plugins import import_object
from rollstream.shared.errors import SettingsError

BUILTIN_AGENTS: Mapping[str, Callable[[AgentConfig], Agent]] = {
    "single_turn": SingleTurnAgent,
    "multi_turn": MultiTurnAgent,
    "tool": ToolAgent,
    "proxy": ProxyAgent,
}


def load_agent(spec: str, config: AgentConfig) -> Agent:
    """The agent ``spec`` names, built from ``config``: a built-in, or a dotted path to a
    class or factory called with the AgentConfig. Anything else is a SettingsError that
    names the spec and what is wrong with it."""
    spec = spec.strip()
    factory = BUILTIN_AGENTS.get(spec)
    if factory is None:
        if "." not in spec and ":" not in spec:
            names = ", ".join(BUILTIN_AGENTS)
            raise SettingsError(
                f"agent {spec!r}: not a built-in agent ({names}) and not a dotted path 'package.module:attr'"
            )
        found = import_object(spec, "agent")
        if not callable(found):
            raise SettingsError(f"agent {spec!r}: {type(found).__name__} object is not callable")
        factory = found
    agent = factory(config)
    if not callable(getattr(agent, "run_group", None)):
        raise SettingsError(
            f"agent {spec!r}: built a {type(agent).__name__}, which has no run_group(rollout, samples)"
        )
    return agent
