"""The parts of the vLLM engine that need no vLLM: its engine arguments and per-actor
environment, the tied-embedding feed of the worker extension, the logprob and
self-check arithmetic, and that importing it does not import vLLM.
(tests/integration/test_engine_vllm.py runs the engine itself.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rollstream.producer.engines import vllm as vllm_engine
from rollstream.producer.engines import vllm_args
from rollstream.producer.engines.base import EngineError
from rollstream.producer.engines.selfcheck import Reference, first_difference
from rollstream.producer.fleet.actors import engine_env
from rollstream.shared.engine_settings import EngineSettings, VLLMEngineSettings
from tests.helpers import require, wait_for_async


def test_importing_the_engine_does_not_import_vllm() -> None:
    code = (
        "import sys, rollstream.producer.engines.vllm, rollstream.producer.fleet.pool; "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_engine_args_pass_the_settings_through_and_extra_args_win() -> None:
    settings = VLLMEngineSettings(
        model="/m", dtype="float32", max_model_len=0, kv_cache_memory_bytes=0, extra_args={"seed": 9, "x": 1}
    )
    args = vllm_args.engine_args(settings)
    assert args["model"] == "/m" and args["dtype"] == "float32"
    assert "max_model_len" not in args and "kv_cache_memory_bytes" not in args  # 0: vLLM's own
    assert args["seed"] == 9 and args["x"] == 1
    assert args["worker_extension_cls"] == vllm_args.WORKER_EXTENSION
    sized = vllm_args.engine_args(VLLMEngineSettings(max_model_len=512, kv_cache_memory_bytes=1 << 28))
    assert sized["max_model_len"] == 512 and sized["kv_cache_memory_bytes"] == 1 << 28


def test_each_vllm_actor_gets_its_own_cpu_binding() -> None:
    engines = EngineSettings(kind="vllm", count=3, vllm=VLLMEngineSettings(cpu_threads_bind=["0", "1"]))
    assert [engine_env(engines, i) for i in range(3)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        {"VLLM_CPU_OMP_THREADS_BIND": "1"},
        {},  # none named: vLLM's default
    ]
    other = EngineSettings(kind="sim", vllm=VLLMEngineSettings(cpu_threads_bind=["0"]))
    assert engine_env(other, 0) == {}


def test_a_model_without_a_directory_is_refused_before_vllm_is_loaded() -> None:
    with pytest.raises(EngineError, match=r"engines\.vllm\.model"):
        vllm_engine.VLLMEngine(VLLMEngineSettings(model="/nonexistent"))


def test_sampled_logprobs_from_dicts_and_from_flat_lists() -> None:
    as_dicts = [{5: SimpleNamespace(logprob=-0.5)}, {7: SimpleNamespace(logprob=-1.5)}]
    assert vllm_args.sampled_logprobs(as_dicts, [5, 7]).tolist() == [-0.5, -1.5]
    flat = SimpleNamespace(logprobs=[-0.25, -2.0], start_indices=[0, 1])
    assert vllm_args.sampled_logprobs(flat, [5, 7]).tolist() == [-0.25, -2.0]


def reference(tokens: list[int], rows: list[list[float]]) -> Reference:
    return Reference(tokens, [np.asarray(r) for r in rows])


def test_first_difference_tells_wrong_tokens_from_near_ties() -> None:
    ref = reference([1, 2, 0], [[0.0, -1.0, -9.0], [-9.0, -5.0, -0.1], [-0.2, -0.2005, -9.0]])
    assert first_difference([1, 2, 0], ref, 1e-3) is None
    assert first_difference([1, 0, 0], ref, 1e-3) == 1  # 8.9 below transformers' choice: wrong
    assert first_difference([1, 2, 1], ref, 1e-3) is None  # 5e-4 apart: a near-tie
    assert first_difference([1, 2], ref, 1e-3) == 2  # shorter


def test_tied_weights_feed_the_embeddings_as_lm_head_when_the_files_lack_it(tmp_path: Path) -> None:
    torch = require("torch", "hf")
    safetensors_torch = require("safetensors.torch", "hf")
    from rollstream.producer.engines.vllm_worker import checkpoint_files, tied_weights

    embed = torch.arange(6.0).reshape(3, 2)
    safetensors_torch.save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(2)}, tmp_path / "a.safetensors"
    )
    files = checkpoint_files(str(tmp_path))
    fed = dict(tied_weights(files, ties=True))
    assert set(fed) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert torch.equal(fed["lm_head.weight"], embed)
    assert "lm_head.weight" not in dict(tied_weights(files, ties=False))
    # a checkpoint with its own lm_head keeps it
    safetensors_torch.save_file({"lm_head.weight": torch.zeros(3, 2)}, tmp_path / "b.safetensors")
    fed = dict(tied_weights(checkpoint_files(str(tmp_path)), ties=True))
    assert torch.equal(fed["lm_head.weight"], torch.zeros(3, 2))


def test_published_weights_follow_the_index_into_earlier_steps(tmp_path: Path) -> None:
    """A step that sent only its changed tensors: the worker reads the model by the index
    (the rest from the earlier step's directory), not the step directory's files alone."""
    torch = require("torch", "hf")
    from rollstream.producer.engines.vllm_worker import published_weights
    from rollstream.shared.transports import TransportSettings, sender_for

    tensors = {
        "model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2),
        "model.norm.weight": torch.ones(2),
    }
    sender = sender_for(TransportSettings(changed_only=True, full_every=0), str(tmp_path))
    sender.send(1, tensors)
    tensors["model.norm.weight"].add_(1.0)
    second = sender.send(2, tensors)
    fed = dict(published_weights(second, ties=True))
    assert set(fed) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert torch.equal(fed["model.norm.weight"], torch.full((2,), 2.0))
    assert torch.equal(fed["lm_head.weight"], tensors["model.embed_tokens.weight"])
    sender.close()


def test_published_weights_come_over_the_collective_transport_too() -> None:
    torch = require("torch", "hf")
    from rollstream.producer.engines.vllm_worker import published_weights
    from rollstream.shared.transports import TransportSettings, sender_for

    tensors = {
        "model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2),
        "model.norm.weight": torch.ones(2),
    }
    sender = sender_for(TransportSettings(kind="collective"), "")
    try:
        fed = dict(published_weights(sender.send(1, tensors), ties=True))
    finally:
        sender.close()
    assert set(fed) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert all(torch.equal(fed[k], v) for k, v in tensors.items())


def test_the_self_check_reference_reads_a_step_of_only_the_changed_tensors(tmp_path: Path) -> None:
    """engines.vllm.self_check builds its transformers reference from what the engine was
    given: a changed-only step's directory through its index (its files alone would be
    refused as an incomplete checkpoint)."""
    torch = require("torch", "hf")
    require("transformers", "hf")
    from rollstream.producer.engines.selfcheck import hf_model
    from rollstream.shared.transports import TransportSettings, sender_for, unique_tensors
    from tests.hf_fixtures import load_model, save_model

    base = save_model(tmp_path / "base", seed=1)
    trainer = load_model(base)
    sender = sender_for(TransportSettings(changed_only=True, full_every=0), str(tmp_path / "w"))
    sender.send(1, unique_tensors(trainer.state_dict()))
    with torch.no_grad():
        trainer.model.norm.weight.add_(1.0)
    second = sender.send(2, unique_tensors(trainer.state_dict()))
    sender.close()
    reference = hf_model(str(base), second).state_dict()
    assert all(torch.equal(reference[k], v) for k, v in trainer.state_dict().items())


def test_a_weights_directory_without_safetensors_is_named(tmp_path: Path) -> None:
    from rollstream.producer.engines.vllm_worker import checkpoint_files

    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        checkpoint_files(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_files(str(tmp_path / "missing"))


def test_an_abort_is_asked_again_until_its_request_ends() -> None:
    """AsyncLLM ignores an abort of a request it has not registered yet (it awaits input
    processing first): the engine asks again until the request is gone."""

    class LLM:  # AsyncLLM's abort, recorded; the engine needs no more of it here
        errored = False

        def __init__(self) -> None:
            self.aborts: list[list[str]] = []

        async def abort(self, ids: list[str]) -> None:
            self.aborts.append(list(ids))

    async def main() -> None:
        engine = object.__new__(vllm_engine.VLLMEngine)  # without vLLM: the parts abort uses
        engine.llm, engine._dead, engine._aborting = LLM(), "", set()
        engine._requests = {"r": 2, "other": 1}
        assert await engine.abort(["r", "unknown"]) == 1
        await wait_for_async(lambda: len(engine.llm.aborts) >= 3)  # not registered yet: again
        assert all(ids == ["r"] for ids in engine.llm.aborts)
        del engine._requests["r"]  # the abort took: the request ended
        await wait_for_async(lambda: not engine._aborting)
        asked = len(engine.llm.aborts)
        assert await engine.abort(["r"]) == 0 and len(engine.llm.aborts) == asked  # nothing to ask

    asyncio.run(main())
