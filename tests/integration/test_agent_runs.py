"""Agent runs through a real redis-server with real producers (the in-process pool):
the guess-the-number example on the sim engine, the calculator example with every
kind of tool failure on a plug-in engine that calls tools (tests/plugins/agent_engine.py),
a weight sync in the middle of a trajectory in each mode, and a trajectory aborted
by a pause in partial mode that resumes from its last complete turn. What a trainer
reads back is decoded from the stream: format 1.1, masks, turns, statuses, rewards."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from rollstream.consumer.tensors import to_padded
from rollstream.producer.assembly import build_producer
from rollstream.producer.prompts import read_prompt_file
from rollstream.producer.worker import Producer
from rollstream.shared import codec
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import PAUSE, RESUME, WEIGHT_SYNC
from rollstream.shared.records import ENV, MODEL, TOOL, Group, Prompt
from rollstream.shared.settings import load_settings
from tests.helpers import require, still_running, wait_for_async
from tests.plugins.agent_engine import AgentEngine

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
GUESS = "rollstream.producer.agents.examples:GuessNumber"
ENV_RETURN = "rollstream.producer.agents.rewards:env_return"
PLUGIN = "tests.plugins.agent_engine:make"
GUESSING = {"agent": "multi_turn", "agent_options": {"env": GUESS}, "judge": ENV_RETURN, "max_turns": 4}


def producer_for(
    url: str, run: str, *, engines: dict[str, Any], producer: dict[str, Any], n: int = 2, **more: Any
) -> Producer:
    settings = load_settings(
        run=run,
        redis={"url": url},
        tasks=[{"name": "agent", "n": n}],
        buffer={"claim_idle_ms": 5000, "max_attempts": 3},
        engines={"count": 1, **engines},
        rollout={"mode": "async", "batch_size": 4, "max_staleness": 4, **more.pop("rollout", {})},
        producer={"is_valid": "keep_all", "heartbeat_s": 0.2, "max_tokens": 256, **producer},
        **more,
    )
    return build_producer(redis.Redis.from_url(url), settings, name="p1")


def read_groups(producer: Producer) -> list[Group]:
    entries = producer.buffer.client.xrange(producer.buffer.keys.groups("agent"))
    assert all(fields[b"format"] == b"1.1" for _, fields in entries)  # agent trajectories
    return producer.buffer.read_batch("agent", 100).groups


def check_trajectory(sample: Any) -> None:
    """What holds of every trajectory: turns cover the response, the mask is the model's."""
    assert sum(t.length for t in sample.turns) == len(sample.response_ids)
    mask = [int(t.role == MODEL) for t in sample.turns for _ in range(t.length)]
    assert sample.loss_mask.tolist() == mask
    assert sample.turns[0].role == MODEL or sample.turns[0].role == ENV
    assert sample.turns[-1].role == MODEL or sample.turns[-1].length == 0


def guess_prompts(count: int, start: int = 0) -> list[Prompt]:
    return read_prompt_file(EXAMPLES / "guess.jsonl", "agent")[start : start + count]


def test_the_guess_the_number_example_on_the_sim_engine(redis_server: EmbeddedRedis, run_name: str) -> None:
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"sim": {"time_compression": 200.0, "median_tokens": 12, "sigma": 0.3, "accuracy": 0.5}},
        producer={
            "agent": "multi_turn",
            "agent_options": {"env": GUESS},
            "judge": ENV_RETURN,
            "max_turns": 4,
        },
    )
    prompts = guess_prompts(4)
    producer.buffer.feed(prompts)
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    groups = read_groups(producer)
    assert sorted(g.prompt.uid for g in groups) == sorted(p.uid for p in prompts)
    statuses = set()
    for group in groups:
        secret = int(group.prompt.meta["answer"])
        for sample in group.samples:
            check_trajectory(sample)
            statuses.add(sample.agent_status)
            model = [t for t in sample.turns if t.role == MODEL]
            observations = [t.text.strip() for t in sample.turns if t.role == ENV]
            # the sim answers the hint: right, or too high by 1..9; the game says so
            for turn in model[:-1]:
                assert "gives \\boxed{" in turn.text and turn.reward == 0.0
            assert all(o == "user: lower" for o in observations)
            right = f"\\boxed{{{secret}}}" in model[-1].text
            assert sample.agent_status == ("done" if right else "max_turns")
            assert sample.reward["score"] == (1.0 if right else 0.0)  # env_return's
            assert sample.reward["turns"] == len(model)
    assert "done" in statuses and statuses <= {"done", "max_turns"}
    # a trainer's tensors train on the model's turns alone
    tensors = to_padded(groups, np.zeros(sum(g.n for g in groups)))
    assert tensors.num_tokens == sum(int(s.loss_mask.sum()) for g in groups for s in g.samples)


def test_the_calculator_example_with_every_tool_failure(redis_server: EmbeddedRedis, run_name: str) -> None:
    tools = {
        "calculator": "rollstream.producer.agents.examples:calculator",
        "slow": "tests.plugins.tools:slow",
        "die": "tests.plugins.tools:die",
    }
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": PLUGIN},
        producer={
            "agent": "tool",
            "agent_options": {"tools": tools, "tool_timeout_s": 2.0},  # the subprocess sandbox
            "judge": "math",
            "max_turns": 3,
        },
    )
    (base,) = read_prompt_file(EXAMPLES / "calculator.jsonl", "agent")[:1]
    tags = ["", "[unknown]", "[malformed]", "[slow]", "[crash]"]
    prompts = [
        Prompt(uid=f"c{i}", task="agent", prompt=f"{base.prompt}{tag}", meta=base.meta)
        for i, tag in enumerate(tags)
    ]
    producer.buffer.feed(prompts)
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    groups = {g.prompt.uid: g for g in read_groups(producer)}
    expected = {
        "c0": ("ok", "calculator", '"result": ' + str(base.meta["answer"]), 1.0),
        "c1": ("unknown_tool", "abacus", "unknown tool 'abacus'; the tools are calculator, die, slow", 0.0),
        "c2": ("malformed", None, "malformed tool call: not JSON", 0.0),
        "c3": ("timeout", "slow", "tool 'slow' timed out after 2 s", 0.0),
        "c4": ("error", "die", "tool 'die' failed: its process exited with code 9", 0.0),
    }
    assert sorted(groups) == sorted(expected)
    for uid, (status, name, says, score) in expected.items():
        for sample in groups[uid].samples:
            check_trajectory(sample)
            call, result, answer = sample.turns
            assert (call.role, result.role, answer.role) == (MODEL, TOOL, MODEL)
            assert (result.status, result.name) == (status, name) and says in result.text, (uid, result)
            # the model read the result and answered after it; the math judge scored that answer
            assert sample.agent_status == "done"
            assert sample.reward["score"] == score, (uid, sample.text)


async def _released(engine: AgentEngine, producer: Producer, step: int, mode: str) -> None:
    """Publish a weight sync while the engine holds turn 1, and let the turn go on."""
    producer.control.publish(WEIGHT_SYNC, step)
    if mode == "drain":  # the sync waits for the turn in flight: let it finish first
        await wait_for_async(lambda: not producer.pool.hosts[0]._open.is_set())  # type: ignore[attr-defined]
    else:
        await wait_for_async(lambda: engine.step == step)
    engine.release.set()


@pytest.mark.parametrize("mode", ["drain", "abort", "partial"])
def test_a_weight_sync_in_the_middle_of_a_trajectory_follows_the_mode(
    redis_server: EmbeddedRedis, run_name: str, mode: str
) -> None:
    AgentEngine.made.clear()
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": PLUGIN, "options": {"hold_turn": 1}},
        producer={
            "agent": "multi_turn",
            "agent_options": {"env": GUESS},
            "judge": ENV_RETURN,
            "max_turns": 4,
        },
        rollout={"on_weight_sync": mode},
        n=1,
    )
    producer.buffer.feed(guess_prompts(1))
    (engine,) = AgentEngine.made

    async def main() -> None:
        task = asyncio.create_task(producer.run(burst=True))
        await wait_for_async(lambda: still_running(task) and engine.holding.is_set(), timeout=30)
        await _released(engine, producer, 1, mode)
        await asyncio.wait_for(task, 60)

    asyncio.run(main())
    (group,) = read_groups(producer)
    for sample in group.samples:
        check_trajectory(sample)
        assert sample.agent_status == "done"  # the third guess is right
        versions = [sample.response_versions[s : s + t.length].tolist() for t, s in _spans(sample)]
        model = [v for v, (t, _) in zip(versions, _spans(sample), strict=True) if t.role == MODEL]
        if mode == "abort":  # made again from the prompt, on the new weights alone
            assert set(sample.response_versions.tolist()) == {1}
        elif mode == "drain":  # the turn in flight finished on step 0, the next on step 1
            assert [set(v) for v in model] == [{0}, {0}, {1}]
        else:  # partial: the turn in flight took the new weights in place
            assert [set(v) for v in model] == [{0}, {0, 1}, {1}]
            assert model[1] == sorted(model[1])
    outcomes = producer.stats.outcomes
    assert outcomes == ({"aborted": 1, "completed": 1} if mode == "abort" else {"completed": 1})


def _spans(sample: Any) -> list[tuple[Any, int]]:
    out, start = [], 0
    for turn in sample.turns:
        out.append((turn, start))
        start += turn.length
    return out


def test_a_paused_trajectory_resumes_from_its_last_complete_turn(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    AgentEngine.made.clear()
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": PLUGIN, "options": {"hold_turn": 1}},
        producer={
            "agent": "multi_turn",
            "agent_options": {"env": GUESS},
            "judge": ENV_RETURN,
            "max_turns": 4,
        },
        rollout={"on_weight_sync": "partial"},
        n=1,
    )
    producer.buffer.feed(guess_prompts(1))
    (engine,) = AgentEngine.made

    async def paused() -> None:
        task = asyncio.create_task(producer.run(burst=True))
        await wait_for_async(lambda: still_running(task) and engine.holding.is_set(), timeout=30)
        producer.control.publish(PAUSE)  # partial mode: in-flight work is aborted, its tokens kept
        await asyncio.wait_for(task, 60)  # burst: a paused producer with nothing in flight ends

    asyncio.run(paused())
    ((_, fields),) = producer.buffer.client.xrange(producer.buffer.keys.aborted("agent"))
    assert fields[b"format"] == b"1.1"
    (before,) = codec.decode_group(fields).samples
    # the complete turn (a guess and its answer) was kept; the turn cut off was dropped
    assert [t.role for t in before.turns] == [MODEL, ENV]
    assert before.status.value == "aborted" and before.agent_status is None
    producer.control.publish(RESUME)
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    (group,) = read_groups(producer)
    (after,) = group.samples
    n = len(before.response_ids)
    assert after.response_ids[:n].tolist() == before.response_ids.tolist()  # the same tokens
    assert after.response_versions[:n].tolist() == before.response_versions.tolist()
    assert [t.text for t in after.turns[:2]] == [t.text for t in before.turns]
    assert [t.role for t in after.turns] == [MODEL, ENV, MODEL, ENV, MODEL]
    assert after.agent_status == "done" and after.reward["score"] == 1.0
    # turn 0 was asked of the engine once: the resume went on with turns 1 and 2
    assert [context.count("\nuser: ") for _, context in engine.requests] == [0, 1, 1, 2]
    assert producer.stats.outcomes == {"aborted": 1, "completed": 1}


# --- the examples on the hf engine -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("transformers", "hf")
    from tests.hf_fixtures import save_model

    return save_model(tmp_path_factory.mktemp("tiny"), seed=3)


def record_generations(producer: Producer) -> list[tuple[list[int], list[int]]]:
    """(context, response ids) of every generation the hf engine makes."""
    made: list[tuple[list[int], list[int]]] = []
    engine: Any = producer.pool.hosts[0].engine  # type: ignore[attr-defined]
    generate = engine.generate

    async def recorded(prompt_ids: list[int], params: Any, n: int = 1, request_id: str | None = None) -> Any:
        generations = await generate(prompt_ids, params, n, request_id)
        made.extend((list(prompt_ids), g.response_ids.tolist()) for g in generations)
        return generations

    engine.generate = recorded
    return made


@pytest.mark.parametrize("example", ["guess", "calculator"])
def test_the_examples_on_the_hf_engine_store_what_the_model_sampled(
    redis_server: EmbeddedRedis, run_name: str, tiny_model: Path, example: str
) -> None:
    agent: dict[str, Any] = (
        GUESSING
        if example == "guess"
        else {
            "agent": "tool",
            "agent_options": {"tools": {"calculator": "rollstream.producer.agents.examples:calculator"}},
            "judge": "math",
        }
    )
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": "hf", "hf": {"model": str(tiny_model)}},
        producer={**agent, "max_turns": 3, "max_tokens": 8},
    )
    made = record_generations(producer)
    hf = producer.runner.tokenizer.tokenizer  # type: ignore[attr-defined]
    producer.buffer.feed(read_prompt_file(EXAMPLES / f"{example}.jsonl", "agent")[:2])
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    groups = read_groups(producer)
    assert len(groups) == 2
    sampled = {tuple(ids) for _, ids in made}
    contexts = {tuple(context) for context, _ in made}
    for group in groups:
        for sample in group.samples:
            check_trajectory(sample)
            assert sample.agent_status in ("done", "max_turns")
            start = 0
            for turn in sample.turns:
                ids = sample.response_ids[start : start + turn.length].tolist()
                if turn.role == MODEL:
                    assert tuple(ids) in sampled  # exactly what the engine sampled
                    # ...given exactly the sequence before it
                    assert (
                        tuple(sample.prompt_ids.tolist() + sample.response_ids[:start].tolist()) in contexts
                    )
                else:  # tokenised once, without special tokens
                    assert ids == hf.encode(turn.text, add_special_tokens=False)
                start += turn.length
            if example == "calculator":  # a random model writes no tool call: its first turn is its answer
                assert [t.role for t in sample.turns] == [MODEL] and sample.agent_status == "done"
            else:  # it names no number the game's secret is: the game goes on to max_turns
                assert [t.role for t in sample.turns][:2] == [MODEL, ENV]


def test_an_engine_failing_mid_trajectory_has_the_group_made_again_elsewhere(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    AgentEngine.made.clear()
    AgentEngine.failures = 1
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": PLUGIN, "count": 2, "options": {"fail_turn": 1}},
        producer=GUESSING,
    )
    producer.buffer.feed(guess_prompts(1))
    asyncio.run(asyncio.wait_for(producer.run(burst=True), 60))
    first, second = AgentEngine.made
    assert producer.stats.outcomes == {"completed": 1} and producer.runner.retries == 1
    # attempt 1 ran on one engine (its turns pinned to the engine of its first request)
    # until turn 1 failed there; attempt 2, the whole group again, on the other
    attempts = [
        {rid.rsplit("#", 1)[1].split(".")[0] for rid, _ in e.requests if rid} for e in (first, second)
    ]
    assert attempts == [{"1"}, {"2"}]
    assert {rid.split(".", 1)[1] for rid, _ in second.requests if rid} == {"0.0", "0.1", "0.2", "1.1", "1.2"}
    # what attempt 1 had issued was aborted on its engine, in case it ran on elsewhere
    issued = {a.rsplit("#", 1)[1] for a in first.aborted}
    assert "1.0.0" in issued and issued & {"1.0.1", "1.1.1"} and issued <= {"1.0.0", "1.0.1", "1.1.1"}
    (group,) = read_groups(producer)
    for sample in group.samples:
        check_trajectory(sample)
        assert sample.agent_status == "done" and len([t for t in sample.turns if t.role == MODEL]) == 3


def test_a_pause_between_turns_ends_the_trajectory_at_its_last_complete_turn(
    redis_server: EmbeddedRedis, run_name: str
) -> None:
    AgentEngine.made.clear()
    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": PLUGIN},
        producer={
            "agent": "tool",
            "agent_options": {"tools": {"slow": "tests.plugins.tools:slow"}, "tool_timeout_s": 1.0},
            "judge": "math",
        },
        rollout={"on_weight_sync": "partial"},
        n=1,
    )
    (base,) = read_prompt_file(EXAMPLES / "calculator.jsonl", "agent")[:1]
    producer.buffer.feed([Prompt("slow", "agent", f"{base.prompt}[slow]", meta=base.meta)])
    (engine,) = AgentEngine.made

    async def main() -> None:
        task = asyncio.create_task(producer.run(burst=True))
        # the model called the tool, which runs: no request is on the engine
        await wait_for_async(
            lambda: still_running(task) and len(engine.requests) == 1 and not producer.runner.inflight
        )
        producer.control.publish(PAUSE)
        await asyncio.wait_for(task, 30)

    asyncio.run(main())
    assert len(engine.requests) == 1  # no turn started after the pause
    ((_, fields),) = producer.buffer.client.xrange(producer.buffer.keys.aborted("agent"))
    (kept,) = codec.decode_group(fields).samples
    assert [(t.role, t.status) for t in kept.turns] == [(MODEL, None), (TOOL, "timeout")]
    assert kept.status.value == "aborted"
    assert producer.stats.outcomes == {"aborted": 1}
