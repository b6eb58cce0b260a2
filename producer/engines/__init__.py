"""Inference engines, one file each, behind the protocol in base.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.settings import EngineSettings

if TYPE_CHECKING:
    from producer.engines.base import Engine


def make_engine(settings: EngineSettings) -> Engine:
    """The engine the settings name; hf imports torch only when chosen."""
    if settings.kind == "sim":
        from producer.engines.sim import SimEngine

        return SimEngine(settings.sim)
    if settings.kind == "hf":
        from producer.engines.hf import HFEngine

        return HFEngine(settings.hf)
    raise ValueError(f"unknown engine kind {settings.kind!r}")  # settings already refuse it
