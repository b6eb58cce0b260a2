"""LoRA with adapter-only weight syncs (algorithm.lora_rank > 0): the trainer trains an
adapter (peft) with its base frozen, a sync sends the adapter's tensors only, through the
file transport or a plain step directory, and an hf engine merges them into the weights
it loaded, so that it computes what the trainer's adapted model computes, step after step
and after a restart. A tiny random Llama (tests/hf_fixtures.py); the real model's byte
ratio is in tests/integration/test_real_model.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import require

torch = require("torch", "hf")
require("transformers", "hf", load=False)
require("peft", "lora", load=False)

from rollstream.consumer.losses import AlgorithmConfig
from rollstream.consumer.pg import PolicyGradient
from rollstream.producer.engines.base import EngineError
from rollstream.producer.engines.hf import HFEngine
from rollstream.producer.engines.hf_weights import merge_adapters
from rollstream.shared.engine_settings import HFEngineSettings
from rollstream.shared.transports import LORA_A, LORA_B, TransportSettings
from tests.hf_fixtures import save_model

LORA = AlgorithmConfig(lora_rank=4, lora_alpha=8, lora_targets=["q_proj", "v_proj"])
INPUT = [[1, 5, 9, 13, 17, 4, 8]]


def train_a_step(policy: PolicyGradient, seed: int) -> None:
    """One optimizer step of the policy on a loss that moves every trainable weight."""
    torch.manual_seed(seed)
    ids = torch.randint(4, 30, (2, 9))
    loss = policy.model(input_ids=ids).logits.logsumexp(-1).mean()
    policy.optimizer.zero_grad()
    loss.backward()
    policy.optimizer.step()


def logits(model: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=torch.tensor(INPUT)).logits


def base_weights(policy: PolicyGradient) -> dict[str, Any]:
    return {k: v.clone() for k, v in policy.model.get_base_model().state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("transport", ["file", "shm", "step-directory"])
def test_the_engine_computes_what_the_trainers_adapter_does(tmp_path: Path, transport: str) -> None:
    model_dir = save_model(tmp_path / "model", seed=3)
    weights = (
        TransportSettings(kind=transport, dir=str(tmp_path / "sent"))  # type: ignore[arg-type]
        if transport != "step-directory"
        else None
    )
    policy = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2, algorithm=LORA, weights=weights)
    before = base_weights(policy)
    engine = HFEngine(HFEngineSettings(model=str(model_dir)))
    for step in (1, 2):
        train_a_step(policy, seed=step)
        sent = policy.tensors()
        # only the adapter travels: an A and a B for each q and v projection, nothing else
        assert sorted({k.rsplit(".", 1)[-1] for k in sent}) == ["lora_A", "lora_B"]
        assert len(sent) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
        uri = policy.save(step)
        if transport == "shm":  # the shared buffer holds the adapter's bytes, nothing more
            shm: Any = policy._sender
            moved = shm.last["bytes"]
            assert moved == sum(t.numel() * t.element_size() for t in sent.values())
        asyncio.run(engine.update_weights(step, uri))
        policy.model.eval()
        assert torch.allclose(logits(engine.model), logits(policy.model), atol=1e-5)
        policy.model.train()
        assert engine.model_step == step
    # the base never trained: the adapter is all that moved
    after = base_weights(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # an engine that starts now (or restarted) needs the last sync only
    fresh = HFEngine(HFEngineSettings(model=str(model_dir)))
    asyncio.run(fresh.update_weights(2, uri))
    assert torch.allclose(logits(fresh.model), logits(engine.model), atol=1e-6)


def test_an_adapter_that_does_not_fit_is_refused_before_anything_changes() -> None:
    params = {"m.q_proj.weight": torch.zeros(6, 4)}
    a, b = torch.ones(2, 4), torch.ones(6, 2)
    base: dict[str, Any] = {}
    with pytest.raises(EngineError, match="half an adapter"):
        merge_adapters("u", {"m.q_proj" + LORA_A: a}, params, base)
    with pytest.raises(EngineError, match="layers the model lacks"):
        merge_adapters("u", {"m.k_proj" + LORA_A: a, "m.k_proj" + LORA_B: b}, params, base)
    with pytest.raises(EngineError, match="has shapes"):
        merge_adapters("u", {"m.q_proj" + LORA_A: torch.ones(2, 5), "m.q_proj" + LORA_B: b}, params, base)
    merged = merge_adapters("u", {"m.q_proj" + LORA_A: a, "m.q_proj" + LORA_B: b}, params, base)
    assert torch.equal(merged["m.q_proj.weight"], torch.full((6, 4), 2.0))
    params["m.q_proj.weight"].copy_(merged["m.q_proj.weight"])  # the engine applied it
    again = merge_adapters("u", {"m.q_proj" + LORA_A: a, "m.q_proj" + LORA_B: b}, params, base)
    assert torch.equal(again["m.q_proj.weight"], torch.full((6, 4), 2.0))  # on the base, not on top


def test_the_trained_policy_is_a_directory_anyone_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = save_model(tmp_path / "model", seed=5)
    policy = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2, algorithm=LORA)
    train_a_step(policy, seed=1)
    saved = policy.save_pretrained(tmp_path / "trained", str(model_dir))
    loaded: Any = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)  # no peft in sight
    policy.model.eval()
    assert torch.allclose(logits(loaded), logits(policy.model), atol=1e-5)
    assert not torch.allclose(
        logits(loaded), logits(AutoModelForCausalLM.from_pretrained(model_dir)), atol=1e-4
    )
    assert AutoTokenizer.from_pretrained(saved).chat_template  # the tokenizer went with it
    train_a_step(policy, seed=2)  # the policy still trains: the merge was a copy's


@pytest.mark.parametrize("transport", ["file", "shm", "step-directory"])
def test_the_vllm_workers_merge_makes_the_trainers_adapted_model(tmp_path: Path, transport: str) -> None:
    """What a vLLM engine's workers load for an adapter-only sync (vllm_worker.py, run here
    without vLLM; tests/integration/test_engine_vllm.py runs it in vLLM): the whole model
    of the directory the engine started from, the adapter merged, the same at every sync."""
    from transformers import AutoModelForCausalLM

    from rollstream.producer.engines.selfcheck import hf_model
    from rollstream.producer.engines.vllm_worker import published_weights

    model_dir = save_model(tmp_path / "model", seed=3)
    weights = (
        TransportSettings(kind=transport, dir=str(tmp_path / "sent"))  # type: ignore[arg-type]
        if transport != "step-directory"
        else None
    )
    policy = PolicyGradient(str(model_dir), str(tmp_path / "out"), lr=1e-2, algorithm=LORA, weights=weights)
    engine: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for step in (1, 2):
        train_a_step(policy, seed=step)
        uri = policy.save(step)
        state = dict(published_weights(uri, ties=False, base=str(model_dir)))
        assert not [k for k in state if k.endswith((LORA_A, LORA_B))]
        assert set(state) >= {k for k in engine.state_dict() if k != "lm_head.weight"}
        engine.load_state_dict(state, strict=False)  # what vLLM's reload does with them
        policy.model.eval()
        assert torch.allclose(logits(engine), logits(policy.model), atol=1e-5)
        policy.model.train()
    # the engine's start-up self-check reads the same weights the same way
    assert torch.allclose(logits(hf_model(str(model_dir), uri)), logits(engine), atol=1e-6)
    with pytest.raises(ValueError, match="no base model was named"):
        next(published_weights(uri, ties=False))


def test_the_vllm_workers_merge_refuses_an_adapter_that_does_not_fit(tmp_path: Path) -> None:
    from rollstream.producer.engines.vllm_worker import merged_adapter

    model_dir = save_model(tmp_path / "model", seed=3)
    layer = "model.layers.0.self_attn.q_proj"
    a, b = torch.ones(2, 4), torch.ones(6, 2)
    for adapter, why in (
        ({layer + LORA_A: a}, "half an adapter for \\['model.layers.0"),
        ({"model.none" + LORA_A: a, "model.none" + LORA_B: b}, "layers the model lacks \\['model.none"),
        ({layer + LORA_A: a, layer + LORA_B: b}, "other shapes \\['model.layers.0"),
    ):
        with pytest.raises(ValueError, match=why):
            next(merged_adapter(adapter, str(model_dir), ties=True, where="u"))
