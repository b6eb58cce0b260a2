"""Prompt text to token ids on the producer side, for the engine the settings name.

The sim engine has no vocabulary of its own: its prompts are UTF-8 bytes (which
also lets it read "What is a + b?" and answer). The hf engine's tokenizer is
loaded from its model directory, with its chat template for chat prompts.
"""

from __future__ import annotations

from typing import Any, Protocol

from shared.records import PromptText
from shared.settings import EngineSettings


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

        self.tokenizer: Any = AutoTokenizer.from_pretrained(model)

    def encode(self, prompt: PromptText) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))


def make_tokenizer(settings: EngineSettings) -> Tokenizer:
    return HFTokenizer(settings.hf.model) if settings.kind == "hf" else BytesTokenizer()
