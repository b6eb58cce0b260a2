"""The proxy agent (producer/agents/proxy.py) over real HTTP on a free loopback port,
with scripted engines: an episode is one trajectory of the sampled ids and what each
call added, tokenised once; a call that rewrites the history, asks for n > 1 or mixes
endpoints is refused with its reason; an abort or a timeout hands the group back with
nothing kept."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from tests.helpers import require, wait_for_async

require("aiohttp", "proxy")

from rollstream.producer.agents.base import AgentConfig, Rollout
from rollstream.producer.agents.proxy import ProxyAgent
from rollstream.producer.agents.proxy_http import SHUTDOWN_S
from rollstream.producer.agents.registry import load_agent
from rollstream.producer.agents.text import TurnText
from rollstream.producer.tokenizer import BytesTokenizer, HFTokenizer
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ENV, MODEL, TOOL, Prompt, Sample, Status
from tests.unit.test_agents import PROMPT, PROMPT_IDS, Engine, b, fresh
from tests.unit.test_agents_tokens import CHAT, CharacterModel, tokenizer  # noqa: F401 (a fixture)

CHAT_PROMPT = Prompt(uid="g1", task="guess", prompt=CHAT, meta={"answer": 42})


def proxy(max_trajectory_tokens: int = 0, **options: Any) -> ProxyAgent:
    agent = load_agent("proxy", AgentConfig(32, 4, max_trajectory_tokens, "partial", {"port": 0, **options}))
    assert isinstance(agent, ProxyAgent)
    return agent


async def with_episodes(
    agent: ProxyAgent,
    rollout: Rollout,
    samples: list[Sample],
    play: Callable[[httpx.AsyncClient, list[dict[str, Any]]], Awaitable[None]],
) -> list[Sample]:
    """Serve ``samples`` as episodes, let ``play`` take them all and play them."""
    await agent.startup()
    try:
        group = asyncio.create_task(agent.run_group(rollout, samples))
        async with httpx.AsyncClient(base_url=agent.url, timeout=10) as http:
            episodes = []
            for _ in samples:
                answer = await http.post("/episodes", json={"wait_s": 5})
                assert answer.status_code == 200, answer.text
                episodes.append(answer.json())
            await play(http, episodes)
        return await asyncio.wait_for(group, 10)
    finally:
        await agent.shutdown()


def chat(base: str, messages: list[dict[str, str]], **more: Any) -> dict[str, Any]:
    """The keyword arguments of a chat call (http.post(**chat(...)))."""
    return {"url": f"{base}/chat/completions", "json": {"model": "policy", "messages": messages, **more}}


def test_a_chat_episode_is_the_sampled_ids_and_what_each_call_added_tokenised_once(
    tokenizer: HFTokenizer,  # noqa: F811
) -> None:
    hf = tokenizer.tokenizer
    model = CharacterModel(tokenizer, ["guess 45", "guess 42"])
    prompt_ids = tokenizer.encode(CHAT)
    rollout = Rollout(CHAT_PROMPT, prompt_ids, tokenizer, model, "guess:g1#1-0#1")
    replies: list[dict[str, Any]] = []

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        (episode,) = episodes
        assert episode["prompt"] == CHAT and episode["meta"] == {"answer": 42}
        messages = list(CHAT)
        for observation in ("lower", None):
            answer = await http.post(**chat(episode["base_url"], messages))
            assert answer.status_code == 200, answer.text
            replies.append(answer.json())
            messages.append(answer.json()["choices"][0]["message"])
            if observation:
                messages.append({"role": "user", "content": observation})
        done = await http.post(f"/episodes/{episode['episode_id']}/reward", json={"reward": 1.0})
        assert done.status_code == 200 and done.json()["reward"] == 1.0

    (sample,) = asyncio.run(with_episodes(proxy(), rollout, [fresh(1)[0]], play))

    assert [r["choices"][0]["message"]["content"] for r in replies] == ["guess 45", "guess 42"]
    assert replies[0]["object"] == "chat.completion" and replies[0]["choices"][0]["finish_reason"] == "stop"
    observation_ids, observation = TurnText(tokenizer, CHAT).encode("user", "lower")
    first, second = model.sampled
    assert sample.status is Status.COMPLETED and sample.agent_status == "done"
    assert sample.prompt_ids.tolist() == prompt_ids
    assert sample.response_ids.tolist() == first + observation_ids + second
    assert [(t.role, t.length, t.text) for t in sample.turns] == [
        (MODEL, len(first), "guess 45"),
        (ENV, len(observation_ids), observation),
        (MODEL, len(second), "guess 42"),
    ]
    assert [t.reward for t in sample.turns] == [None, None, 1.0]  # the reported reward, on the last turn
    assert sample.loss_mask.tolist() == [1] * len(first) + [0] * len(observation_ids) + [1] * len(second)
    # the second call reached the engine as ids: the first turn as sampled, then the message
    assert model.contexts[1] == prompt_ids + first + observation_ids
    # what a proxy that re-rendered the chat history would have sent instead
    rendered = hf.encode(
        hf.apply_chat_template(
            [*CHAT, {"role": "assistant", "content": "guess 45"}, {"role": "user", "content": "lower"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    assert rendered != model.contexts[1]


def scripted(
    replies: list[list[str]], before: Callable[[int, int], Awaitable[None]] | None = None
) -> tuple[Engine, Rollout]:
    """An engine that says episode i's turn t as ``replies[i][t]`` (after awaiting
    ``before(i, t)``, which may hold or fail the request)."""
    engine = Engine(replies)

    async def request(ids: list[int], n: int, max_tokens: int, rid: str, stop: Any) -> Any:
        # the proxy's request ids end in /<episode>.<turn>: answer episode - 1's script
        episode, turn = (int(x) for x in rid.rsplit("/", 1)[1].split("."))
        engine.requests.append({"ids": list(ids), "n": n, "max_tokens": max_tokens, "id": rid, "stop": stop})
        if before is not None:
            await before(episode - 1, turn)
        return [engine.reply(episode - 1, turn, max_tokens)]

    return engine, Rollout(PROMPT, PROMPT_IDS, BytesTokenizer(), request, "guess:q1#1-0#1")


def test_completions_with_text_or_token_ids_continue_the_trajectory() -> None:
    engine, rollout = scripted([["4", "2"], ["4", "1"]])

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        by_text, by_ids = episodes
        url = f"{by_text['base_url']}/completions"
        first = (await http.post(url, json={"prompt": PROMPT.prompt, "max_tokens": 8})).json()
        assert first["object"] == "text_completion" and first["choices"][0]["text"] == "4"
        again = {"prompt": f"{PROMPT.prompt}4\ntool: no\n", "max_tokens": 8}
        assert (await http.post(url, json=again)).status_code == 200
        await http.post(f"/episodes/{by_text['episode_id']}/reward", json={"reward": 0.5})

        url = f"{by_ids['base_url']}/completions"
        first = (await http.post(url, json={"prompt": PROMPT_IDS})).json()
        assert first["choices"][0]["text"] == "4"
        wrong = await http.post(url, json={"prompt": [*PROMPT_IDS, *b("5")]})
        assert wrong.status_code == 409 and wrong.json()["error"]["type"] == "history_mismatch"
        assert (await http.post(url, json={"prompt": [*PROMPT_IDS, *b("4"), *b("?")]})).status_code == 200
        await http.post(f"/episodes/{by_ids['episode_id']}/reward", json={"reward": 0.0})

    by_text, by_ids = asyncio.run(with_episodes(proxy(), rollout, fresh(2), play))
    assert by_text.response_ids.tolist() == b("4") + b("\ntool: no\n") + b("2")
    assert [(t.role, t.length) for t in by_text.turns] == [
        (MODEL, 1),
        (ENV, len(b("\ntool: no\n"))),
        (MODEL, 1),
    ]
    assert by_text.turns[-1].reward == 0.5
    assert by_ids.response_ids.tolist() == b("4") + b("?") + b("1")
    assert by_ids.loss_mask.tolist() == [1, 0, 1]
    assert engine.requests[1]["max_tokens"] == 8 and engine.requests[2]["max_tokens"] == 32  # capped, default


def test_calls_that_do_not_fit_an_episode_are_refused_with_their_reason() -> None:
    engine, rollout = scripted([["12", "3", "4", "5"]])
    refusals: list[tuple[int, str]] = []

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        (episode,) = episodes
        base, reward = episode["base_url"], f"/episodes/{episode['episode_id']}/reward"
        user = [{"role": "user", "content": PROMPT.prompt}]

        async def refused(url: str, json: dict[str, Any]) -> None:
            answer = await http.post(url, json=json)
            refusals.append((answer.status_code, answer.json()["error"]["message"]))

        await refused(reward, json={"reward": 1.0})  # no model turn yet
        await refused(**chat(base, user, n=2))
        await refused(**chat(base, user, max_tokens=0))
        assert (await http.post(**chat(base, user))).status_code == 200
        await refused(f"{base}/completions", json={"prompt": "x"})  # the other endpoint
        rewritten = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "12"}]
        await refused(**chat(base, rewritten))
        injected = [*user, {"role": "assistant", "content": "12"}, {"role": "assistant", "content": "13"}]
        await refused(**chat(base, injected))
        await refused(reward, json={"reward": "high"})
        await refused("/episodes/nope/reward", json={"reward": 1.0})
        tool_result = [*user, {"role": "assistant", "content": "12"}, {"role": "tool", "content": "3"}]
        assert (await http.post(**chat(base, tool_result))).status_code == 200
        assert (await http.post(reward, json={"reward": 1.0})).status_code == 200
        await refused(**chat(base, tool_result))  # over

    (sample,) = asyncio.run(with_episodes(proxy(), rollout, fresh(1), play))
    *codes, over = [code for code, _ in refusals]
    assert codes == [400, 400, 400, 400, 409, 400, 400, 404] and over in (404, 409)
    messages = [m for _, m in refusals]
    assert "no model turn" in messages[0] and "n must be 1" in messages[1]
    assert "max_tokens" in messages[2] and "chat episode" in messages[3]
    assert "message 0 differs" in messages[4] and "assistant messages come from the model" in messages[5]
    assert "reward must be a number" in messages[6] and "no open episode 'nope'" in messages[7]
    assert "has its reward already" in messages[8] or "no open episode" in messages[8]
    # refused calls changed nothing: two model turns and the tool's result between them
    tool_turn = b("\ntool: 3\nassistant:")
    assert [(t.role, t.length) for t in sample.turns] == [(MODEL, 2), (TOOL, len(tool_turn)), (MODEL, 1)]
    assert sample.response_ids.tolist() == b("12") + tool_turn + b("3")
    assert len(engine.requests) == 2


def test_an_abort_ends_the_episodes_of_the_group_and_hands_it_back_with_nothing_kept() -> None:
    engine, rollout = scripted([["12", "3"], ["45", "6"]])
    engine.abort_at.add((0, 1))  # episode 1's second turn comes back aborted
    answers: list[httpx.Response] = []

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        one, two = episodes
        user = [{"role": "user", "content": PROMPT.prompt}]
        assert (await http.post(**chat(one["base_url"], user))).status_code == 200
        assert (await http.post(**chat(two["base_url"], user))).status_code == 200
        follow = [*user, {"role": "assistant", "content": "12"}, {"role": "user", "content": "lower"}]
        answers.append(await http.post(**chat(one["base_url"], follow)))
        answers.append(await http.post(f"/episodes/{two['episode_id']}/reward", json={"reward": 1.0}))

    samples = asyncio.run(with_episodes(proxy(), rollout, fresh(2), play))
    assert answers[0].status_code == 409 and answers[0].json()["error"]["type"] == "episode_aborted"
    assert answers[1].status_code in (404, 409)  # the group is gone, or going
    assert rollout.aborting
    assert all(s.status is Status.ABORTED and len(s.response_ids) == 0 and s.turns is None for s in samples)


def test_episodes_without_a_reward_in_time_hand_the_group_back() -> None:
    _, rollout = scripted([["1"]])

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        (episode,) = episodes
        url = f"/episodes/{episode['episode_id']}/reward"

        async def gone() -> bool:
            return (await http.post(url, json={"reward": 1.0})).status_code != 400  # 400: no model turn yet

        deadline = asyncio.get_running_loop().time() + 10
        while not await gone():
            assert asyncio.get_running_loop().time() < deadline, "the episode never timed out"
            await asyncio.sleep(0.05)

    (sample,) = asyncio.run(with_episodes(proxy(episode_timeout_s=0.3), rollout, fresh(1), play))
    assert sample.status is Status.ABORTED and len(sample.response_ids) == 0
    assert rollout.aborting


def test_no_episode_open_is_a_204_and_bad_options_name_the_setting() -> None:
    async def main() -> int:
        agent = proxy()
        await agent.startup()
        try:
            async with httpx.AsyncClient(base_url=agent.url) as http:
                assert (await http.get("/health")).json()["status"] == "ok"
                return (await http.post("/episodes", json={"wait_s": 0.05})).status_code
        finally:
            await agent.shutdown()

    assert asyncio.run(main()) == 204
    with pytest.raises(SettingsError, match=r"producer.agent_options.*'proxy' has no option 'prot'"):
        proxy(prot=1)
    with pytest.raises(SettingsError, match=r"producer.agent_options.*port must be a number in \[0, 65535\]"):
        proxy(port="http")


class Held:
    """``before`` for scripted(): holds turn ``turn`` of every episode until released."""

    def __init__(self, turn: int) -> None:
        self.turn, self.reached, self.release = turn, asyncio.Event(), asyncio.Event()

    async def __call__(self, episode: int, turn: int) -> None:
        if turn == self.turn:
            self.reached.set()
            await self.release.wait()


class CountingLock(asyncio.Lock):
    """An episode's lock that counts the calls waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0

    async def acquire(self) -> bool:
        self.waiting += 1
        try:
            return await super().acquire()
        finally:
            self.waiting -= 1


class CountingQueue(asyncio.Queue):  # type: ignore[type-arg]
    """The proxy's queue of episodes, counting the agents waiting to take one."""

    takers = 0

    async def get(self) -> Any:
        self.takers += 1
        try:
            return await super().get()
        finally:
            self.takers -= 1


def test_a_refused_or_failed_call_leaves_the_episode_as_it_was_for_the_retry() -> None:
    failures = [RuntimeError("the engine went away")]

    async def fail_once(episode: int, turn: int) -> None:
        if turn == 1 and failures:
            raise failures.pop()

    engine, rollout = scripted([["12", "3"]], before=fail_once)
    answers: list[int] = []

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        (episode,) = episodes
        base, user = episode["base_url"], [{"role": "user", "content": PROMPT.prompt}]
        assert (await http.post(**chat(base, user))).status_code == 200
        said = [*user, {"role": "assistant", "content": "12"}]
        follow = [*said, {"role": "user", "content": "lower"}]
        too_long = [*said, {"role": "user", "content": "much lower"}]  # over max_trajectory_tokens
        for call in (chat(base, follow, max_tokens=0), chat(base, follow, stop=5), chat(base, too_long)):
            answers.append((await http.post(**call)).status_code)
        answers.append((await http.post(**chat(base, follow))).status_code)  # the engine fails
        assert (await http.post(**chat(base, follow))).status_code == 200, "the retry"
        assert (
            await http.post(f"/episodes/{episode['episode_id']}/reward", json={"reward": 1.0})
        ).status_code == 200

    turn = b("\nuser: lower\nassistant:")
    agent = proxy(max_trajectory_tokens=len(b("12")) + len(turn) + 1)
    (sample,) = asyncio.run(with_episodes(agent, rollout, fresh(1), play))
    assert answers == [400, 400, 400, 500]
    # the user's message is in the trajectory once, though the call was made five times
    assert [(t.role, t.length) for t in sample.turns] == [(MODEL, 2), (ENV, len(turn)), (MODEL, 1)]
    assert sample.response_ids.tolist() == b("12") + turn + b("3")
    prompt_ids = sample.prompt_ids.tolist()
    assert [r["ids"] for r in engine.requests[1:]] == [prompt_ids + b("12") + turn] * 2  # failed, retried


async def reward_behind_a_held_call(
    http: httpx.AsyncClient, agent: ProxyAgent, episode: dict[str, Any], held: Held
) -> tuple[asyncio.Task[httpx.Response], asyncio.Task[httpx.Response], list[dict[str, str]], CountingLock]:
    """The first turn played; the second call held in the engine; the reward posted and
    waiting for the episode's lock behind it. Returns the call, the reward, the second
    call's messages and the lock."""
    lock = agent.episodes[episode["episode_id"]].lock = CountingLock()
    base, user = episode["base_url"], [{"role": "user", "content": PROMPT.prompt}]
    assert (await http.post(**chat(base, user))).status_code == 200
    follow = [*user, {"role": "assistant", "content": "12"}, {"role": "user", "content": "lower"}]
    call = asyncio.create_task(http.post(**chat(base, follow)))
    await held.reached.wait()
    reward = asyncio.create_task(http.post(f"/episodes/{episode['episode_id']}/reward", json={"reward": 1.0}))
    await wait_for_async(lambda: lock.waiting == 1)
    return call, reward, follow, lock


def test_a_reward_waiting_behind_a_call_that_is_aborted_is_refused() -> None:
    held = Held(turn=1)
    engine, rollout = scripted([["12", "3"]], before=held)
    engine.abort_at.add((0, 1))
    answers: list[httpx.Response] = []

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        (episode,) = episodes
        call, reward, _, _ = await reward_behind_a_held_call(http, agent, episode, held)
        held.release.set()
        answers.extend(await asyncio.gather(call, reward))

    agent = proxy()
    (sample,) = asyncio.run(with_episodes(agent, rollout, fresh(1), play))
    assert [a.status_code for a in answers] == [409, 409]
    assert all(a.json()["error"]["type"] == "episode_aborted" for a in answers)
    assert sample.status is Status.ABORTED and len(sample.response_ids) == 0


def test_a_call_waiting_behind_the_reward_finds_the_episode_over() -> None:
    held = Held(turn=1)
    engine, rollout = scripted([["12", "3", "4"]], before=held)
    answers: list[httpx.Response] = []

    async def play(http: httpx.AsyncClient, episodes: list[dict[str, Any]]) -> None:
        (episode,) = episodes
        call, reward, follow, lock = await reward_behind_a_held_call(http, agent, episode, held)
        again = [*follow, {"role": "assistant", "content": "3"}, {"role": "user", "content": "higher"}]
        late = asyncio.create_task(http.post(**chat(episode["base_url"], again)))
        await wait_for_async(lambda: lock.waiting == 2)
        held.release.set()
        answers.extend(await asyncio.gather(call, reward, late))

    agent = proxy()
    (sample,) = asyncio.run(with_episodes(agent, rollout, fresh(1), play))
    assert [a.status_code for a in answers] == [200, 200, 409]
    assert answers[2].json()["error"]["type"] == "episode_over"
    assert len(engine.requests) == 2  # nothing generated on the finished episode
    assert sample.status is Status.COMPLETED and [t.role for t in sample.turns] == [MODEL, ENV, MODEL]


def test_wait_s_0_takes_an_episode_already_waiting_past_ended_ones() -> None:
    _, rollout = scripted([["1"], ["1"]])

    async def main() -> tuple[str, httpx.Response, httpx.Response]:
        agent = proxy()
        await agent.startup()
        group = asyncio.create_task(agent.run_group(rollout, fresh(2)))
        try:
            await wait_for_async(lambda: agent.waiting.qsize() == 2)
            first, second = agent.episodes.values()
            first.abort("its agent went away")  # still in the queue: skipped
            async with httpx.AsyncClient(base_url=agent.url, timeout=10) as http:
                taken = await http.post("/episodes", json={"wait_s": 0})
                none_left = await http.post("/episodes", json={"wait_s": 0})
            return second.id, taken, none_left
        finally:
            await agent.shutdown()
            await asyncio.wait_for(group, 10)

    second, taken, none_left = asyncio.run(main())
    assert taken.status_code == 200 and taken.json()["episode_id"] == second
    assert none_left.status_code == 204


def test_the_episodes_of_a_group_that_ended_untaken_leave_the_queue() -> None:
    _, gone = scripted([["1"], ["1"]])
    _, kept = scripted([["1"], ["1"]])

    async def main() -> tuple[list[Sample], int, httpx.Response]:
        agent = proxy()
        await agent.startup()
        later = asyncio.create_task(agent.run_group(kept, fresh(2)))
        try:
            samples = asyncio.create_task(agent.run_group(gone, fresh(2)))
            await wait_for_async(lambda: agent.waiting.qsize() == 4)
            gone.aborting = True  # a pause: the group ends, no agent took its episodes
            ended = await asyncio.wait_for(samples, 10)
            async with httpx.AsyncClient(base_url=agent.url, timeout=10) as http:
                open_episodes = (await http.get("/health")).json()["open_episodes"]
                taken = await http.post("/episodes", json={"wait_s": 0})
            return ended, open_episodes, taken
        finally:
            await agent.shutdown()
            await asyncio.wait_for(later, 10)

    ended, open_episodes, taken = asyncio.run(main())
    assert all(s.status is Status.ABORTED for s in ended)
    assert open_episodes == 2  # the other group's
    assert taken.status_code == 200 and taken.json()["uid"] == "q1"


def test_shutdown_answers_the_agents_waiting_for_an_episode_at_once() -> None:
    async def main() -> int:
        agent = proxy()
        agent.waiting = queue = CountingQueue()
        await agent.startup()
        async with httpx.AsyncClient(base_url=agent.url, timeout=30) as http:
            take = asyncio.create_task(http.post("/episodes", json={"wait_s": 3600}))
            await wait_for_async(lambda: queue.takers == 1)
            await asyncio.wait_for(agent.shutdown(), SHUTDOWN_S - 1)  # not aiohttp's grace period
            return (await take).status_code

    assert asyncio.run(main()) == 204


def test_a_port_in_use_or_not_an_integer_is_a_settings_error_naming_it() -> None:
    with pytest.raises(SettingsError, match=r"producer.agent_options.*port must be an integer, got 8080.5"):
        proxy(port=8080.5)

    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            agent = proxy(port=port)
            with pytest.raises(SettingsError, match=rf"cannot serve on 127\.0\.0\.1:{port}"):
                await agent.startup()
            assert agent._runner is None  # cleaned up

    asyncio.run(main())
