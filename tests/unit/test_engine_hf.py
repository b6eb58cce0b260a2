"""The hf engine on a tiny random Llama built on the spot (tests/hf_fixtures.py): no hub,
no network, seconds on a CPU. torch and transformers are the optional "hf" extra:
without them this module is skipped."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.helpers import require

torch = require("torch", "hf")
require("transformers", "hf")
# The engine and the fixtures import torch themselves: only after the skips above

from rollstream.producer.engines.base import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    SamplingParams,
)
from rollstream.producer.engines.hf import HFEngine
from rollstream.shared.engine_settings import HFEngineSettings
from tests.helpers import wait_for, wait_for_async
from tests.hf_fixtures import make_tokenizer, save_model

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny models that differ only in their random weights."""
    tokenizer = make_tokenizer()
    root = tmp_path_factory.mktemp("hf")
    return save_model(root / "a", seed=1, tokenizer=tokenizer), save_model(
        root / "b", seed=2, tokenizer=tokenizer
    )


@pytest.fixture
def engine(model_dirs: tuple[Path, Path]) -> HFEngine:
    # One engine per test: its asyncio primitives bind to the loop of each test's asyncio.run
    return HFEngine(HFEngineSettings(model=str(model_dirs[0])), model_step=3)


def count_steps(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the engine's decode steps, so tests wait on progress, not on time."""
    steps = [0]
    step = engine._step

    def counted(*args: Any) -> Any:
        steps[0] += 1
        return step(*args)

    monkeypatch.setattr(engine, "_step", counted)
    return steps


async def wait_for_steps(steps: list[int], count: int) -> None:
    await wait_for_async(lambda: steps[0] >= count, timeout=60, interval=0.001)


async def outstanding(engine: HFEngine) -> int:
    return (await engine.health()).outstanding


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_generates_n_samples(engine: HFEngine) -> None:
    prompt = engine.encode_prompt(PROMPT)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=0)
    gens = run(engine.generate(prompt, params, n=4))
    assert len(gens) == 4
    for gen in gens:
        assert 1 <= len(gen.response_ids) <= 10
        assert len(gen.logprobs) == len(gen.versions) == len(gen.response_ids)
        assert gen.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        assert (gen.finish_reason == FINISH_STOP) == (gen.response_ids[-1] == engine.tokenizer.eos_token_id)
        assert set(gen.versions.tolist()) == {3}
        assert (gen.logprobs <= 0).all()
        assert gen.text == engine.tokenizer.decode(gen.response_ids, skip_special_tokens=True)
    assert len({tuple(g.response_ids.tolist()) for g in gens}) > 1  # sampled, not copied


def test_logprobs_are_the_raw_distribution(engine: HFEngine) -> None:
    """Tempered, top-p sampling; the logprobs still match a plain forward pass."""
    prompt = engine.encode_prompt(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)
    gens = run(engine.generate(prompt, params, n=3))
    for gen in gens:
        ids = torch.tensor([prompt + gen.response_ids.tolist()])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        assert torch.allclose(torch.from_numpy(gen.logprobs), expected, atol=1e-4)


def test_seed_determinism_and_greedy_argmax(engine: HFEngine) -> None:
    prompt = engine.encode_prompt(PROMPT)

    def sample(seed: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=12, seed=seed, ignore_eos=True)
        return [g.response_ids.tolist() for g in run(engine.generate(prompt, params, n=2))]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)

    tokens = run(engine.generate(prompt, greedy(), n=2))[0].response_ids.tolist()
    ids = list(prompt)
    for _ in range(12):  # argmax, one full forward pass per token, no cache
        with torch.no_grad():
            ids.append(int(engine.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(prompt) :]


def test_stop_string(engine: HFEngine) -> None:
    prompt = engine.encode_prompt(PROMPT)
    full = run(engine.generate(prompt, greedy(16)))[0]
    words = full.text.split()
    assert len(words) >= 6 and len(words[4]) >= 2, full.text
    # From the middle, across two tokens, ending inside the second: the text is cut there
    stop = f"{words[3]} {words[4][:-1]}"
    params = greedy(16)
    params.stop = ["no such text", stop]
    gen = run(engine.generate(prompt, params))[0]
    assert gen.finish_reason == FINISH_STOP
    assert gen.text.endswith(stop) and stop not in gen.text[: -len(stop)]
    # The response is the shortest greedy prefix whose text holds the stop string
    ids = full.response_ids.tolist()
    k = next(k for k in range(1, len(ids) + 1) if stop in engine.tokenizer.decode(ids[:k]))
    assert gen.response_ids.tolist() == ids[:k] and k < len(ids)
    assert engine.tokenizer.decode(ids[:k]) == gen.text + words[4][-1]


def test_top_p_keeps_the_most_likely_token(engine: HFEngine) -> None:
    """A top_p below the top token's mass leaves only that token: sampling is greedy."""
    prompt = engine.encode_prompt(PROMPT)
    expected = run(engine.generate(prompt, greedy()))[0].response_ids.tolist()
    for seed in range(3):
        params = SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=seed, ignore_eos=True)
        gens = run(engine.generate(prompt, params, n=2))
        assert [g.response_ids.tolist() for g in gens] == [expected, expected]


def test_stop_token_ids(engine: HFEngine) -> None:
    prompt = engine.encode_prompt(PROMPT)
    full = run(engine.generate(prompt, greedy()))[0]
    ids = full.response_ids.tolist()
    params = greedy()
    params.stop_token_ids = [ids[2]]
    params.stop = ["no such text"]
    gen = run(engine.generate(prompt, params))[0]
    assert gen.finish_reason == FINISH_STOP
    assert gen.response_ids.tolist() == ids[: ids.index(ids[2]) + 1]
    assert gen.text and full.text.startswith(gen.text)


def test_update_weights_changes_outputs_and_versions(engine: HFEngine, model_dirs: tuple[Path, Path]) -> None:
    prompt = engine.encode_prompt(PROMPT)

    async def scenario() -> tuple[Any, Any, Any]:
        before = (await engine.generate(prompt, greedy()))[0]
        await engine.update_weights(4, str(model_dirs[1]))
        after = (await engine.generate(prompt, greedy()))[0]
        health = await engine.health()
        return before, after, health

    before, after, health = run(scenario())
    assert before.response_ids.tolist() != after.response_ids.tolist()
    assert set(after.versions.tolist()) == {4} and health.model_step == 4
    reference = HFEngine(HFEngineSettings(model=str(model_dirs[1])))
    assert run(reference.generate(prompt, greedy()))[0].response_ids.tolist() == after.response_ids.tolist()


def test_update_weights_mid_request_stamps_later_tokens(
    engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = engine.encode_prompt(PROMPT)
    steps = count_steps(engine, monkeypatch)

    async def scenario() -> Any:
        task = asyncio.create_task(engine.generate(prompt, greedy(400), request_id="r"))
        await wait_for_steps(steps, 3)  # the third step runs: two tokens are in, on step 3
        await engine.update_weights(9)  # no path: only the step moves, between two decode steps
        # two more steps started: the first of them, on step 9, has added its token
        await wait_for_steps(steps, steps[0] + 2)
        assert await engine.abort(["r"]) == 1
        return (await task)[0]

    gen = run(scenario())
    versions = gen.versions.tolist()
    assert versions[0] == 3 and versions[-1] == 9 and versions == sorted(versions)


def test_abort_returns_partial_tokens(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = engine.encode_prompt(PROMPT)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, seed=0)

    steps = count_steps(engine, monkeypatch)

    async def scenario() -> tuple[list[Any], int, Any]:
        task = asyncio.create_task(engine.generate(prompt, params, n=2, request_id="long"))
        await wait_for_steps(steps, 3)
        count = await engine.abort()
        gens = await task
        return gens, count, await engine.health()

    gens, count, health = run(asyncio.wait_for(scenario(), 60))  # not the 100,000 tokens
    assert count == 1 and health.outstanding == 0
    for gen in gens:
        assert gen.finish_reason == FINISH_ABORT
        assert 3 <= len(gen.response_ids) < 1000 and len(gen.versions) == len(gen.response_ids)


def test_cancelled_request_leaves_the_engine_usable(
    engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = engine.encode_prompt(PROMPT)
    steps = count_steps(engine, monkeypatch)

    async def scenario() -> tuple[Any, Any]:
        task = asyncio.create_task(engine.generate(prompt, greedy(100_000)))
        await wait_for_steps(steps, 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        health = await engine.health()
        return health, (await engine.generate(prompt, greedy(5)))[0]

    health, gen = run(scenario())
    assert health.outstanding == 0 and len(gen.response_ids) == 5


def test_pause_holds_decoding_until_resume(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = engine.encode_prompt(PROMPT)

    steps = count_steps(engine, monkeypatch)

    async def scenario() -> tuple[Any, Any, int]:
        task = asyncio.create_task(engine.generate(prompt, greedy(200)))
        await wait_for_steps(steps, 2)
        await engine.pause()  # returns with no step in flight
        health = await engine.health()
        held = steps[0]
        # no condition to wait on: the check is that no step runs while paused, over a
        # stretch in which an unpaused engine runs many
        await asyncio.sleep(0.1)
        assert not task.done()
        held = steps[0] - held
        await engine.resume()
        return (await task)[0], health, held

    gen, health, held = run(scenario())
    assert held == 0
    assert health.paused and health.outstanding == 1 and health.running == 0
    assert gen.finish_reason == FINISH_LENGTH and len(gen.response_ids) == 200


def test_abort_while_paused(engine: HFEngine) -> None:
    prompt = engine.encode_prompt(PROMPT)

    async def scenario() -> Any:
        await engine.pause()
        task = asyncio.create_task(engine.generate(prompt, greedy(30)))
        await wait_for_async(lambda: outstanding(engine))
        assert await engine.abort() == 1
        return (await asyncio.wait_for(task, 5))[0]

    gen = run(scenario())
    assert gen.finish_reason == FINISH_ABORT and len(gen.response_ids) == 0


def test_chat_template(engine: HFEngine) -> None:
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": "what is two plus two ?"}]
    ids = engine.encode_prompt(messages)
    expected = ["<s>", "user", ":", "what", "is", "two", "plus", "two", "?", "</s>", "assistant", ":"]
    assert ids == tokenizer.convert_tokens_to_ids(expected)
    assert engine.encode_prompt("two plus two") == tokenizer.convert_tokens_to_ids(
        ["<s>", "two", "plus", "two"]
    )


def test_missing_model_dir_and_bad_weights(tmp_path: Path, engine: HFEngine) -> None:
    with pytest.raises(EngineError, match="nowhere"):
        HFEngine(HFEngineSettings(model=str(tmp_path / "nowhere")))
    with pytest.raises(EngineError, match="safetensors"):
        run(engine.update_weights(1, str(tmp_path)))
    other = save_model(tmp_path / "wide", seed=0, hidden=16)
    with pytest.raises(EngineError):
        run(engine.update_weights(1, str(other)))
    assert engine.model_step == 3


def test_decodes_while_the_event_loop_is_held(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode thread runs step after step on its own: a request goes on while the
    caller's event loop is held (a hand-off through the loop at each step stands still)."""
    prompt = engine.encode_prompt(PROMPT)
    steps = count_steps(engine, monkeypatch)

    async def scenario() -> Any:
        task = asyncio.create_task(engine.generate(prompt, greedy(400), request_id="r"))
        await wait_for_steps(steps, 1)
        wait_for(lambda: steps[0] >= 20, timeout=30, interval=0.001)  # holds the loop
        assert await engine.abort(["r"]) == 1
        return (await task)[0]

    gen = run(scenario())
    assert gen.finish_reason == FINISH_ABORT and 20 <= len(gen.response_ids) < 400


def test_concurrent_requests_decode_in_one_batch(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of different prompt lengths, greedy and seeded, running together: each
    gets what it gets alone (tokens, logprobs), from shared forward passes."""
    texts = ["the cat sat on the mat", "a quick brown fox", "one two three four five six seven eight"]
    prompts = [engine.encode_prompt(t) for t in texts]
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    params = [greedy(10), sampled, greedy(6)]
    alone = [run(engine.generate(p, q, n=2)) for p, q in zip(prompts, params, strict=True)]
    steps = count_steps(engine, monkeypatch)

    async def together() -> list[list[Any]]:
        # paused while the three are handed in: on a loaded machine the decode thread took
        # its first steps with one of them alone, and the count measured the load
        await engine.pause()
        pairs = zip(prompts, params, strict=True)
        tasks = [asyncio.create_task(engine.generate(p, q, n=2)) for p, q in pairs]
        await wait_for_async(lambda: len(engine._requests) == len(tasks), timeout=30, interval=0.001)
        await engine.resume()
        return list(await asyncio.gather(*tasks))

    both = run(together())
    for mine, theirs in zip(both, alone, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.response_ids.tolist() == b.response_ids.tolist()
            assert torch.allclose(torch.from_numpy(a.logprobs), torch.from_numpy(b.logprobs), atol=1e-4)
    assert steps[0] <= 10 + 2  # one request a step would take 10 + 10 + 6


def test_abort_of_one_request_leaves_the_batch_going(
    engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, other = engine.encode_prompt(PROMPT), engine.encode_prompt("a quick brown fox jumps")
    expected = run(engine.generate(other, greedy(40)))[0].response_ids.tolist()
    steps = count_steps(engine, monkeypatch)

    async def scenario() -> tuple[Any, Any]:
        long = asyncio.create_task(engine.generate(prompt, greedy(100_000), n=3, request_id="long"))
        await wait_for_steps(steps, 2)
        short = asyncio.create_task(engine.generate(other, greedy(40), request_id="short"))
        await wait_for_steps(steps, steps[0] + 4)
        assert await engine.abort(["long"]) == 1
        return (await long), (await short)[0]

    long, short = run(asyncio.wait_for(scenario(), 60))
    assert all(g.finish_reason == FINISH_ABORT for g in long)
    assert short.finish_reason == FINISH_LENGTH and short.response_ids.tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_throughput(tmp_path: Path) -> None:
    """A ~100M-parameter random Llama: decode tokens/s on cuda (bfloat16) beside the CPU."""
    directory = save_model(tmp_path / "big", seed=0, hidden=1024, layers=8, heads=16)
    n = 8
    runs: list[tuple[str, Literal["float32", "bfloat16"], int]] = [
        ("cpu", "float32", 16),
        ("cuda", "bfloat16", 256),
    ]
    for device, dtype, max_tokens in runs:
        engine = HFEngine(HFEngineSettings(model=str(directory), device=device, dtype=dtype))
        prompt = engine.encode_prompt(PROMPT)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0)
        run(engine.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), n=n))  # warm up
        started = time.perf_counter()
        gens = run(engine.generate(prompt, params, n=n))
        elapsed = time.perf_counter() - started
        assert all(len(g.response_ids) == max_tokens for g in gens)
        print(f"{device} {dtype}: {n * max_tokens / elapsed:.0f} tokens/s (n={n}, {max_tokens} tokens each)")


def test_a_bfloat16_engine_takes_float32_weights(model_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """A float32 trainer's weights into a bfloat16 engine: converted on the way in."""
    from tests.hf_fixtures import load_model

    engine = HFEngine(HFEngineSettings(model=str(model_dirs[0]), dtype="bfloat16"))
    run(engine.update_weights(1, str(model_dirs[1])))
    theirs = load_model(model_dirs[1]).state_dict()
    for name, mine in engine.model.state_dict().items():
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs[name].to(torch.bfloat16)), name
    engine.stop()
