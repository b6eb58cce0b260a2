"""The agent loops against a scripted engine, byte tokenizer: the exact token sequence of
each trajectory (model turns as sampled, the others tokenised once), its loss mask,
turns, rewards and statuses; every way a tool call can fail; the turn and token
budgets; environment errors; weight syncs and aborts in the middle of a trajectory,
and the resume from the last complete turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from rollstream.producer.agents.base import AgentConfig, Rollout, Trajectory, gather_or_fail
from rollstream.producer.agents.examples import GuessNumber, calculator, read_guess
from rollstream.producer.agents.registry import load_agent
from rollstream.producer.agents.rewards import env_return
from rollstream.producer.agents.tools import parse_calls
from rollstream.producer.engines.base import FINISH_ABORT, FINISH_STOP, Generation
from rollstream.producer.judges.base import JudgeError
from rollstream.producer.tokenizer import BytesTokenizer
from rollstream.shared import codec
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ENV, MODEL, TOOL, Group, Prompt, Sample, Status

GUESS = "rollstream.producer.agents.examples:GuessNumber"
CALCULATOR = "rollstream.producer.agents.examples:calculator"
THIS = "tests.unit.test_agents"
PROMPT = Prompt(uid="q1", task="guess", prompt="What is 40 + 2?", meta={"answer": "42"})
PROMPT_IDS = list(PROMPT.prompt.encode())  # type: ignore[union-attr]


def b(text: str) -> list[int]:
    return list(text.encode())


class Engine:
    """A scripted engine: trajectory i's turn t says ``replies[i][t]``, as its UTF-8 bytes
    with logprob -(t + 1) / 10 each, at version ``step`` (or the versions ``split``
    gives). Every request is recorded."""

    def __init__(self, replies: Sequence[Sequence[str]], step: int = 0) -> None:
        self.replies = replies
        self.step = step
        self.requests: list[dict[str, Any]] = []
        self.abort_at: set[tuple[int, int]] = set()  # (trajectory, turn) that come back aborted
        self.versions: dict[tuple[int, int], list[int]] = {}

    async def __call__(
        self, ids: list[int], n: int, max_tokens: int, request_id: str, stop: Sequence[str]
    ) -> list[Generation]:
        self.requests.append(
            {"ids": list(ids), "n": n, "max_tokens": max_tokens, "id": request_id, "stop": stop}
        )
        await asyncio.sleep(0)
        first, t = (int(x) for x in request_id.rsplit(".", 2)[1:])
        return [self.reply(i, t, max_tokens) for i in range(first, first + n)]  # n: alike first turns

    def reply(self, i: int, t: int, max_tokens: int) -> Generation:
        text = self.replies[i][t]
        tokens = b(text)[:max_tokens]
        if (i, t) in self.abort_at:
            half = len(tokens) // 2
            return Generation(tokens[:half], [-0.5] * half, [self.step] * half, FINISH_ABORT)
        versions = self.versions.get((i, t), [self.step] * len(tokens))
        return Generation(tokens, [-(t + 1) / 10] * len(tokens), versions, FINISH_STOP, text)


def rollout(engine: Any, prompt: Prompt = PROMPT, mode: str = "partial") -> Rollout:
    ids = list(prompt.prompt.encode())  # type: ignore[union-attr]
    return Rollout(prompt, ids, BytesTokenizer(), engine, "guess:q1#1-0#1", mode)


def fresh(n: int, prompt: Prompt = PROMPT) -> list[Sample]:
    ids = list(prompt.prompt.encode())  # type: ignore[union-attr]
    return [Sample(ids, [], [], [], status=Status.ABORTED) for _ in range(n)]


def agent(name: str, max_turns: int = 4, max_tokens: int = 64, budget: int = 0, **options: Any) -> Any:
    config = AgentConfig(max_tokens, max_turns, budget, "partial", options)
    return load_agent(name, config)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


# --- multi_turn ------------------------------------------------------------------------


def test_a_multi_turn_trajectory_is_the_sampled_ids_and_the_observations_tokenised_once() -> None:
    engine = Engine([["I say \\boxed{45}", "then \\boxed{40}", "so \\boxed{42}"]])
    (sample,) = run(agent("multi_turn", env=GUESS).run_group(rollout(engine), fresh(1)))
    lower, higher = "\nuser: lower\n", "\nuser: higher\n"
    turns = ["I say \\boxed{45}", lower, "then \\boxed{40}", higher, "so \\boxed{42}"]
    assert sample.response_ids.tolist() == b("".join(turns))
    assert sample.prompt_ids.tolist() == PROMPT_IDS
    assert [(t.role, t.length, t.text) for t in sample.turns] == [
        (MODEL if i % 2 == 0 else ENV, len(b(text)), text) for i, text in enumerate(turns)
    ]
    assert [t.reward for t in sample.turns] == [0.0, None, 0.0, None, 1.0]
    assert sample.loss_mask.tolist() == [int(i % 2 == 0) for i, text in enumerate(turns) for _ in b(text)]
    # logprobs as sampled on the model's turns, 0 on the environment's
    assert sample.logprobs.tolist() == pytest.approx(
        [(-(i // 2 + 1) / 10 if i % 2 == 0 else 0.0) for i, text in enumerate(turns) for _ in b(text)]
    )
    assert (sample.status, sample.agent_status, sample.finish_reason) == (
        Status.COMPLETED,
        "done",
        FINISH_STOP,
    )
    assert sample.text == "so \\boxed{42}"  # the final answer, what a judge reads
    # each turn's request continued the whole sequence as it stood: no text went back in
    assert [r["ids"] for r in engine.requests] == [PROMPT_IDS + b("".join(turns[:k])) for k in (0, 2, 4)]
    assert [r["id"] for r in engine.requests] == [f"guess:q1#1-0#1.0.{t}" for t in range(3)]


def test_the_observation_after_the_last_turn_is_not_added_and_max_turns_is_the_status() -> None:
    engine = Engine([["\\boxed{1}"] * 3])
    (sample,) = run(agent("multi_turn", max_turns=3, env=GUESS).run_group(rollout(engine), fresh(1)))
    assert [t.role for t in sample.turns] == [MODEL, ENV, MODEL, ENV, MODEL]  # ends on the model
    assert sample.agent_status == "max_turns"
    assert len(engine.requests) == 3


def test_the_trajectory_token_budget_bounds_each_turn_and_ends_it() -> None:
    obs = len(b("\nuser: higher\n"))
    engine = Engine([["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"]])
    budget = 9 + obs + 5  # turn 0 whole, its observation, 5 tokens of turn 1
    (sample,) = run(agent("multi_turn", budget=budget, env=GUESS).run_group(rollout(engine), fresh(1)))
    assert [r["max_tokens"] for r in engine.requests] == [budget, 5]  # the room left
    assert len(sample.response_ids) == budget
    assert sample.agent_status == "max_tokens"
    # an observation that would leave no room for a model token is not added
    engine = Engine([["\\boxed{1}"] * 3])
    (sample,) = run(agent("multi_turn", budget=9 + obs, env=GUESS).run_group(rollout(engine), fresh(1)))
    assert [t.role for t in sample.turns] == [MODEL]
    assert sample.agent_status == "max_tokens"


def test_a_first_observation_comes_right_after_the_prompt() -> None:
    engine = Engine([["\\boxed{42}"]])
    multi = agent("multi_turn", env=GUESS, env_options={"intro": "guess my number"}, observation_role="game")
    (sample,) = run(multi.run_group(rollout(engine), fresh(1)))
    assert [(t.role, t.text) for t in sample.turns] == [
        (ENV, "\ngame: guess my number\n"),
        (MODEL, "\\boxed{42}"),
    ]
    assert sample.loss_mask.tolist() == [0] * len(b("\ngame: guess my number\n")) + [1] * 10


class Crashing:
    """An environment that fails where the test says."""

    def __init__(self, where: str) -> None:
        self.where = where

    def reset(self, prompt: Prompt) -> str:
        if self.where == "reset":
            raise RuntimeError("no board")
        return ""

    def step(self, action: str) -> Any:
        if self.where == "step":
            raise ValueError("bad move")
        if self.where == "answer":
            return ("fine", "a lot", False)
        return ("fine", 0.0, False)


@pytest.mark.parametrize(
    ("where", "turns", "message"),
    [
        ("reset", 0, "RuntimeError: no board"),
        ("step", 1, "ValueError: bad move"),
        ("answer", 1, "step returned the reward 'a lot', not a finite number"),
    ],
)
def test_an_environment_error_ends_the_trajectory_with_its_status_and_message(
    where: str, turns: int, message: str
) -> None:
    engine = Engine([["\\boxed{1}"] * 3])
    multi = agent("multi_turn", env=f"{THIS}:Crashing", env_options={"where": where})
    (sample,) = run(multi.run_group(rollout(engine), fresh(1)))
    assert sample.agent_status == "env_error"
    assert sample.status is Status.COMPLETED
    last = sample.turns[-1]
    assert (last.role, last.length, last.status) == (ENV, 0, "error")  # seen by nobody, recorded
    assert message in last.text and f"{THIS}:Crashing" in last.text
    assert sum(1 for t in sample.turns if t.role == MODEL) == turns


# --- tool ------------------------------------------------------------------------------


def call(name: str, **arguments: Any) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


PLUGINS = "tests.plugins.tools"  # standard library only: the sandbox imports it at each call
TOOLS = {
    "calculator": CALCULATOR,
    "slow": f"{PLUGINS}:slow",
    "explode": f"{PLUGINS}:explode",
    "die": f"{PLUGINS}:die",
    "noisy": f"{PLUGINS}:noisy",
}


@pytest.mark.parametrize("sandbox", ["inline", "subprocess"])
def test_every_tool_outcome_is_an_observation_and_a_status(sandbox: str) -> None:
    # in processes: a timeout that eleven of them starting at once on a busy machine stay within
    timeout = 3.0 if sandbox == "subprocess" else 0.5
    calls = [
        (call("calculator", expression="40 + 2"), "ok", '{"name": "calculator", "result": 42}'),
        ("<tool_call>{not json}</tool_call>", "malformed", "malformed tool call: not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "malformed", 'no \\"name\\" of the tool'),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            "malformed",
            "is list, not an object",
        ),
        ("<tool_call>{", "malformed", "a <tool_call> without its </tool_call>"),
        (
            call("search", q="x"),
            "unknown_tool",
            "unknown tool 'search'; the tools are calculator, die, explode",
        ),
        (call("slow", seconds=timeout + 1), "timeout", f"tool 'slow' timed out after {timeout:g} s"),
        (call("explode"), "error", "tool 'explode' failed: ZeroDivisionError: boom"),
        (call("calculator", expression="2 ** 999"), "error", "exponent 999 is above 64"),
        (call("noisy"), "ok", '{"name": "noisy", "result": 7}'),
    ]
    if sandbox == "subprocess":  # a process that dies is an error too; inline it would end the test
        calls.append((call("die"), "error", "tool 'die' failed: its process exited with code 9"))
    replies = [[text, "\\boxed{42}"] for text, _, _ in calls]
    engine = Engine(replies)
    tools = agent("tool", max_tokens=200, tools=TOOLS, sandbox=sandbox, tool_timeout_s=timeout)

    async def timed() -> tuple[list[Sample], float]:
        started = time.monotonic()
        samples = await tools.run_group(rollout(engine), fresh(len(calls)))
        return samples, time.monotonic() - started

    samples, took = run(timed())
    assert took < timeout + 0.9  # the slow tool was cut at its timeout
    for i, (sample, (text, status, says)) in enumerate(zip(samples, calls, strict=True)):
        model, result, answer = sample.turns
        assert (model.role, model.text) == (MODEL, text)
        assert (result.role, result.status) == (TOOL, status), result
        assert says in result.text, (says, result.text)
        assert answer.text == "\\boxed{42}" and sample.agent_status == "done"
        # the model read the result: its next turn continued from the result's tokens
        second = next(r for r in engine.requests if r["id"].endswith(f".{i}.1"))
        assert second["ids"] == PROMPT_IDS + b(text + result.text)
        assert sample.loss_mask.tolist() == [1] * model.length + [0] * result.length + [1] * answer.length
    assert all(r["stop"] == ("</tool_call>",) for r in engine.requests)


def test_a_turn_without_a_tool_call_is_the_final_answer() -> None:
    engine = Engine([["it is \\boxed{42}"]])
    (sample,) = run(agent("tool", tools=TOOLS, sandbox="inline").run_group(rollout(engine), fresh(1)))
    assert [t.role for t in sample.turns] == [MODEL]
    assert sample.agent_status == "done"
    assert sample.loss_mask.tolist() == [1] * len(b("it is \\boxed{42}"))


def test_calls_on_the_last_turn_are_not_run() -> None:
    engine = Engine([[call("calculator", expression="1 + 1")] * 2])
    (sample,) = run(
        agent("tool", max_turns=2, tools=TOOLS, sandbox="inline").run_group(rollout(engine), fresh(1))
    )
    assert [t.role for t in sample.turns] == [MODEL, TOOL, MODEL]
    assert sample.agent_status == "max_turns"


def test_tool_calls_are_parsed_in_order_with_the_arguments_as_json_or_text() -> None:
    text = (
        'x <tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call> y '
        '<tool_call>\n{"name": "b", "arguments": "{\\"k\\": 2}"}\n</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    assert [(c.name, c.arguments, c.error) for c in parse_calls(text)] == [
        ("a", {"k": 1}, None),
        ("b", {"k": 2}, None),
        ("c", {}, None),
    ]
    assert parse_calls("no call here") == []


# --- aborts, weight syncs, resume -------------------------------------------------------


def test_an_aborted_trajectory_keeps_its_complete_turns_and_its_group_stops() -> None:
    replies = [["\\boxed{45}", "\\boxed{40}", "\\boxed{42}"], ["\\boxed{10}", "\\boxed{41}", "\\boxed{42}"]]
    engine = Engine(replies)
    engine.abort_at = {(0, 1)}  # trajectory 0's second turn is cut off
    samples = run(agent("multi_turn", env=GUESS).run_group(rollout(engine), fresh(2)))
    assert [s.status for s in samples] == [Status.ABORTED, Status.ABORTED]
    first = samples[0]
    # the complete turn and its observation; the cut-off turn is dropped
    assert [t.text for t in first.turns] == ["\\boxed{45}", "\nuser: lower\n"]
    assert first.response_ids.tolist() == b("\\boxed{45}\nuser: lower\n")
    assert first.agent_status is None and first.finish_reason == FINISH_ABORT
    # no turn of the group starts after the abort came back
    assert len(engine.requests) <= 4
    assert not any(r["id"].endswith(".2") for r in engine.requests)


def test_a_resumed_trajectory_goes_on_from_its_last_complete_turn_on_the_new_weights() -> None:
    replies = [["\\boxed{45}", "\\boxed{40}", "\\boxed{42}"]]
    engine = Engine(replies)
    engine.abort_at = {(0, 1)}
    (aborted,) = run(agent("multi_turn", env=GUESS).run_group(rollout(engine), fresh(1)))
    # through the aborted pool, as the producer hands it back and the next one claims it
    group = Group.for_prompt(PROMPT, samples=[aborted])
    fields = codec.encode_group(group)
    raw = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
    (kept,) = codec.decode_group(raw).samples
    Replaying.made.clear()
    resumed_engine = Engine(replies, step=1)
    multi = agent("multi_turn", env=f"{THIS}:Replaying")
    (sample,) = run(multi.run_group(rollout(resumed_engine), [kept]))
    texts = ["\\boxed{45}", "\nuser: lower\n", "\\boxed{40}", "\nuser: higher\n", "\\boxed{42}"]
    assert [t.text for t in sample.turns] == texts
    assert sample.response_ids.tolist() == b("".join(texts))
    lengths = [len(b(t)) for t in texts]
    # versions: the kept turn and its observation at step 0, the new turns at step 1
    assert sample.response_versions.tolist() == [0] * (lengths[0] + lengths[1]) + [1] * sum(lengths[2:])
    assert [r["id"] for r in resumed_engine.requests] == ["guess:q1#1-0#1.0.1", "guess:q1#1-0#1.0.2"]
    assert resumed_engine.requests[0]["ids"] == PROMPT_IDS + b("".join(texts[:2]))
    # the environment was rebuilt by replaying the kept action before the new ones
    (env,) = Replaying.made
    assert env.actions == ["\\boxed{45}", "\\boxed{40}", "\\boxed{42}"]
    assert sample.agent_status == "done" and sample.status is Status.COMPLETED
    assert [t.reward for t in sample.turns if t.role == MODEL] == [0.0, 0.0, 1.0]  # the kept one kept


class Replaying(GuessNumber):
    made: ClassVar[list[Replaying]] = []

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[str] = []
        Replaying.made.append(self)

    def step(self, action: str) -> tuple[str, float, bool]:
        self.actions.append(action)
        return super().step(action)


def test_versions_span_weight_syncs_between_and_within_turns() -> None:
    # drain: turn 1 ran on step 1; partial: turn 2 switched from step 1 to 2 in the middle
    engine = Engine([["\\boxed{45}", "\\boxed{40}", "\\boxed{42}"]])
    engine.versions = {(0, 0): [0] * 10, (0, 1): [1] * 10, (0, 2): [1] * 4 + [2] * 6}
    (sample,) = run(agent("multi_turn", env=GUESS).run_group(rollout(engine), fresh(1)))
    low, high = len(b("\nuser: lower\n")), len(b("\nuser: higher\n"))
    assert sample.response_versions.tolist() == (
        [0] * 10 + [0] * low + [1] * 10 + [1] * high + [1] * 4 + [2] * 6
    )  # an observation carries the version of the model turn before it
    group = Group.for_prompt(PROMPT, samples=[sample])
    assert group.model_step == 0
    assert orjson_meta(group)["samples"][0]["ver"] == [[0, 10 + low], [1, 10 + high + 4], [2, 6]]


def orjson_meta(group: Group) -> Any:
    import orjson

    return orjson.loads(codec.encode_group(group)["meta"])


def test_abort_mode_aborts_a_trajectory_whose_next_turn_runs_on_newer_weights() -> None:
    engine = Engine([["\\boxed{45}", "\\boxed{40}"], ["\\boxed{45}", "\\boxed{40}"]])
    engine.versions = {(0, 1): [1] * 10}  # trajectory 0 was between turns at the sync
    samples = run(agent("multi_turn", env=GUESS).run_group(rollout(engine, mode="abort"), fresh(2)))
    assert samples[0].status is Status.ABORTED
    assert samples[0].response_versions.tolist() == [0] * len(samples[0].response_ids)  # nothing mixed
    # the same versions in partial mode are a trajectory that spans the sync
    engine.requests.clear()
    samples = run(agent("multi_turn", max_turns=2, env=GUESS).run_group(rollout(engine), fresh(2)))
    assert samples[0].status is Status.COMPLETED and set(samples[0].response_versions.tolist()) == {0, 1}


def test_fresh_trajectories_open_with_one_request_of_n_then_go_their_own_ways() -> None:
    engine = Engine([["\\boxed{42}"], ["\\boxed{45}", "\\boxed{42}"], ["\\boxed{1}", "\\boxed{42}"]])
    samples = run(agent("multi_turn", env=GUESS).run_group(rollout(engine), fresh(3)))
    first, *later = engine.requests
    assert (first["id"], first["n"]) == ("guess:q1#1-0#1.0.0", 3)  # one engine, one prefix, 3 samples
    assert sorted((r["id"], r["n"]) for r in later) == [("guess:q1#1-0#1.1.1", 1), ("guess:q1#1-0#1.2.1", 1)]
    assert [s.text for s in samples] == ["\\boxed{42}"] * 3
    assert [len([t for t in s.turns if t.role == MODEL]) for s in samples] == [1, 2, 2]


def test_a_failed_attempt_cancels_the_other_trajectories() -> None:
    started: list[int] = []

    async def main() -> None:
        async def slow(i: int) -> int:
            started.append(i)
            await asyncio.sleep(10)
            return i

        async def fail() -> int:
            await asyncio.sleep(0.01)
            raise KeyError("engine down")

        t0 = time.monotonic()
        with pytest.raises(KeyError):
            await gather_or_fail([slow(0), fail(), slow(2)])
        assert time.monotonic() - t0 < 2
        assert await gather_or_fail([asyncio.sleep(0, i) for i in range(3)]) == [0, 1, 2]

    run(main())
    assert started == [0, 2]


def test_a_trajectory_in_which_the_model_never_spoke_has_no_tokens() -> None:
    trajectory = Trajectory(PROMPT_IDS)
    trajectory.add_turn(ENV, b("hello"), "hello")
    trajectory.end("max_tokens")
    sample = trajectory.to_sample()
    assert len(sample.response_ids) == 0 and [(t.length, t.text) for t in sample.turns] == [(0, "hello")]
    assert Trajectory.resume(sample).turns == []  # and resumes afresh


# --- single_turn -----------------------------------------------------------------------


def test_single_turn_asks_as_the_producer_always_did() -> None:
    engine = Engine([["abc"], ["abc"]])
    calls: list[tuple[int, int, str]] = []

    async def request(ids: list[int], n: int, max_tokens: int, rid: str, stop: Sequence[str]) -> Any:
        calls.append((n, max_tokens, rid))
        assert list(stop) == []
        return await engine(ids, 1, max_tokens, rid + ".0.0", stop) * n

    samples = run(agent("single_turn", max_tokens=8).run_group(rollout(request), fresh(2)))
    assert calls == [(2, 8, "guess:q1#1-0#1")]  # fresh: one request of n, the attempt's id
    assert all(s.turns is None and s.loss_mask is None and s.agent_status is None for s in samples)
    partial = Sample(PROMPT_IDS, b("ab"), [-0.1, -0.1], [0, 0], status=Status.ABORTED)
    calls.clear()
    (merged,) = run(agent("single_turn", max_tokens=8).run_group(rollout(request), [partial]))
    assert calls == [(1, 6, "guess:q1#1-0#1.0")]  # its own tokens on, with what is left
    assert merged.response_ids.tolist() == b("ababc") and merged.response_versions.tolist() == [0] * 5


# --- plug-ins ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("looping", {}, "not a built-in agent \\(single_turn, multi_turn, tool, proxy\\)"),
        ("single_turn", {"env": GUESS}, "agent 'single_turn' has no option 'env'; its options are none"),
        ("multi_turn", {}, "agent 'multi_turn' needs the option 'env'"),
        ("multi_turn", {"env": "nowhere.mod:Env"}, "producer.agent_options .*module 'nowhere.mod' not found"),
        ("multi_turn", {"env": GUESS, "env_options": [1]}, "env_options must be an object"),
        ("multi_turn", {"env": GUESS, "turn_template": "{who}"}, "turn_template '{who}' is not a format"),
        ("tool", {"tools": {}}, "tools must be an object"),
        ("tool", {"tools": TOOLS, "sandbox": "docker"}, "sandbox must be one of subprocess, inline"),
        ("tool", {"tools": TOOLS, "tool_timeout_s": 0}, "tool_timeout_s must be a number above 0"),
        ("tool", {"tools": {"x": f"{THIS}:nothing"}}, "has no attribute 'nothing'"),
    ],
)
def test_bad_agent_settings_name_what_is_wrong(spec: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_agent(spec, AgentConfig(options=options))


def test_a_plug_in_agent_by_dotted_path() -> None:
    made = load_agent(f"{THIS}:Echo", AgentConfig(max_tokens=3))
    assert isinstance(made, Echo) and made.config.max_tokens == 3
    with pytest.raises(SettingsError, match="has no run_group"):
        load_agent(f"{THIS}:NotAnAgent", AgentConfig())


class Echo:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    async def run_group(self, rollout: Rollout, samples: list[Sample]) -> list[Sample]:
        return samples


class NotAnAgent:
    def __init__(self, config: AgentConfig) -> None:
        pass


def test_examples_and_env_return() -> None:
    assert calculator("(40 + 2) * 3 - 1 / 4") == 125.75
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")
    assert [read_guess(t) for t in ("\\boxed{7} or 9", "maybe 12 or 13", "seven ? four", "none")] == [
        7,
        13,
        4,
        None,
    ]
    engine = Engine([["\\boxed{45}", "\\boxed{42}"], ["\\boxed{1}"] * 4])
    samples = run(agent("multi_turn", env=GUESS).run_group(rollout(engine), fresh(2)))
    assert env_return(PROMPT, samples) == [{"score": 1.0, "turns": 2.0}, {"score": 0.0, "turns": 4.0}]
    with pytest.raises(JudgeError, match="env_return judges agent trajectories"):
        env_return(PROMPT, [Sample([1], [2], [], [0], text="x")])


def test_how_a_turn_is_framed_for_the_byte_tokenizer_and_by_template() -> None:
    from rollstream.producer.agents.text import TurnText

    chat = TurnText(BytesTokenizer(), [{"role": "user", "content": "hi"}])
    assert chat.encode("tool", "42") == (b("\ntool: 42\nassistant:"), "\ntool: 42\nassistant:")
    plain = TurnText(BytesTokenizer(), "hi")
    assert plain.encode("user", "lower") == (b("\nuser: lower\n"), "\nuser: lower\n")
    custom = TurnText(BytesTokenizer(), "hi", "<{role}>{content}</{role}>")
    assert custom.encode("env", "é") == (b("<env>é</env>"), "<env>é</env>")


def test_the_producer_builds_the_agent_its_settings_name(
    fake_client: Any, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollstream.producer.agents.multi import MultiTurnAgent
    from rollstream.producer.assembly import build_producer
    from rollstream.producer.fleet.pool import LocalPool

    monkeypatch.setenv("ROLLSTREAM_PRODUCER__AGENT", "multi_turn")
    monkeypatch.setenv("ROLLSTREAM_PRODUCER__AGENT_OPTIONS", f'{{"env": "{GUESS}"}}')
    settings = make_settings()
    producer = build_producer(fake_client, settings, pool=LocalPool([]), name="p")
    assert isinstance(producer.runner.agent, MultiTurnAgent)
    assert producer.runner.agent.config.max_turns == settings.producer.max_turns == 8
    monkeypatch.setenv("ROLLSTREAM_PRODUCER__AGENT", "looping")
    bad = make_settings()
    match = r"producer.agent \(ROLLSTREAM_PRODUCER__AGENT\): agent 'looping'"
    with pytest.raises(SettingsError, match=match):
        build_producer(fake_client, bad, pool=LocalPool([]), name="p")
