"""The proxy agent (producer/agents/proxy.py) over real HTTP on a free loopback port,
with scripted engines: an episode is one trajectory of the sampled ids and what each
call added, tokenised once; a call that rewrites the history, asks for n > 1 or mixes
endpoints is refused with its reason; an abort or a timeout hands the group back with
nothing kept."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

pytest.importorskip("aiohttp")

from rollstream.producer.agents.base import AgentConfig, Rollout
from rollstream.producer.agents.proxy import ProxyAgent
from rollstream.producer.agents.registry import load_agent
from rollstream.producer.agents.text import TurnText
from rollstream.producer.tokenizer import BytesTokenizer, HFTokenizer
from rollstream.shared.errors import SettingsError
from rollstream.shared.records import ENV, MODEL, TOOL, Prompt, Sample, Status
from tests.unit.test_agents import PROMPT, PROMPT_IDS, Engine, b, fresh
from tests.unit.test_agents_tokens import CHAT, CharacterModel, tokenizer  # noqa: F401 (a fixture)

CHAT_PROMPT = Prompt(uid="g1", task="guess", prompt=CHAT, meta={"answer": 42})


def proxy(**options: Any) -> ProxyAgent:
    agent = load_agent("proxy", AgentConfig(32, 4, 0, "partial", {"port": 0, **options}))
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


def scripted(replies: list[list[str]]) -> tuple[Engine, Rollout]:
    engine = Engine(replies)

    async def request(ids: list[int], n: int, max_tokens: int, rid: str, stop: Any) -> Any:
        # the proxy's request ids end in /<episode>.<turn>: answer episode - 1's script
        episode, turn = (int(x) for x in rid.rsplit("/", 1)[1].split("."))
        engine.requests.append({"ids": list(ids), "n": n, "max_tokens": max_tokens, "id": rid, "stop": stop})
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
