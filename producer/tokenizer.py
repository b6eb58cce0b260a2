"""Prompt text to token ids on the producer side, for the engine the settings name.

The sim engine has no vocabulary of its own: its prompts are UTF-8 bytes (which
also lets it read "What is a + b?" and answer). Engines with a real model (hf, vllm,
and the servers behind openai and sglang) get ids from the model's Hugging Face
tokenizer, with its chat template for chat prompts: the producer tokenizes once, the
engine sees token ids only, and what the trainer gets is exactly what was sampled.
``engines.tokenizer`` names another tokenizer, or ``bytes``.
"""

from __future__ import annotations

from typing import Any, Protocol

from rollstream.shared import models
from rollstream.shared.engine_settings import EngineSettings
from rollstream.shared.records import PromptText


class Tokenizer(Protocol):
    def encode(self, prompt: PromptText) -> list[int]: ...


class BytesTokenizer:
    def encode(self, prompt: PromptText) -> list[int]:
        if isinstance(prompt, str):
            return list(prompt.encode("utf-8"))
        text = "\n".join(f"{m['role']}: {m['content']}" for m in prompt) + "\nassistant:"
        return list(text.encode("utf-8"))


class HFTokenizer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(models.resolve(model))

    def encode(self, prompt: PromptText) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        # rendered, then encoded without special tokens (the template writes its own BOS), as
        # the hf engine does: with tokenize=True, transformers 5 returns a dict, not the ids
        text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def tokenizer_source(settings: EngineSettings) -> str:
    """The HF tokenizer directory or hub id the settings name, or "bytes"."""
    if settings.tokenizer:
        return settings.tokenizer
    model = {
        "hf": settings.hf.model,
        "vllm": settings.vllm.model,
        "openai": settings.openai.model,
        "sglang": settings.sglang.model,
    }.get(settings.kind, "")
    return model or "bytes"


def make_tokenizer(settings: EngineSettings) -> Tokenizer:
    source = tokenizer_source(settings)
    return BytesTokenizer() if source == "bytes" else HFTokenizer(source)
