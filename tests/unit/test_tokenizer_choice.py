"""Which tokenizer a producer uses for each engine kind: the model's own wherever the
engine runs a real model, so that the ids it samples from are the model's ids."""

from __future__ import annotations

import pytest

from rollstream.producer.tokenizer import BytesTokenizer, make_tokenizer, tokenizer_source
from rollstream.shared.engine_settings import EngineSettings


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"kind": "sim"}, "bytes"),
        ({"kind": "hf", "hf": {"model": "/m/hf"}}, "/m/hf"),
        ({"kind": "vllm", "vllm": {"model": "/m/vllm"}}, "/m/vllm"),
        ({"kind": "openai", "openai": {"model": "org/served"}}, "org/served"),
        ({"kind": "sglang", "sglang": {"model": "/m/sgl"}}, "/m/sgl"),
        ({"kind": "openai"}, "bytes"),  # no model named: nothing to load
        ({"kind": "mypkg.engine:make"}, "bytes"),
        ({"kind": "vllm", "vllm": {"model": "/m/vllm"}, "tokenizer": "/m/other"}, "/m/other"),
        ({"kind": "hf", "hf": {"model": "/m/hf"}, "tokenizer": "bytes"}, "bytes"),
    ],
)
def test_the_tokenizer_each_kind_uses(settings: dict[str, object], expected: str) -> None:
    assert tokenizer_source(EngineSettings.model_validate(settings)) == expected


def test_bytes_is_utf8_and_chat_prompts_end_with_the_assistant_turn() -> None:
    tokenizer = make_tokenizer(EngineSettings(kind="vllm", tokenizer="bytes"))
    assert isinstance(tokenizer, BytesTokenizer)
    assert tokenizer.encode("é") == [0xC3, 0xA9]
    ids = tokenizer.encode([{"role": "user", "content": "hi"}])
    assert bytes(ids).decode() == "user: hi\nassistant:"
