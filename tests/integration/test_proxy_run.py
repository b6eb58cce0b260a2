"""`rollstream proxy` as a process on a real redis-server, played by the shipped example
agent (examples/agents/proxy_agent.py), another process that talks to it with the
`openai` client only: the groups it makes are in the stream, format 1.1, each sample the
agent's whole conversation as one trajectory with the reward the agent reported; the
proxy stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.helpers import require

require("aiohttp", "proxy")
require("openai", "test")

from rollstream.producer.agents.examples import read_guess
from rollstream.producer.prompts import read_prompt_file
from rollstream.shared import codec
from rollstream.shared.embedded import EmbeddedRedis, free_port
from rollstream.shared.keys import Keys
from rollstream.shared.records import ENV, MODEL
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import load_settings
from tests.helpers import ProducerProcess, still_running, wait_for, wait_for_async

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "agents"
GROUPS, N = 4, 2
ENV_RETURN = "rollstream.producer.agents.rewards:env_return"


def test_an_outside_agent_on_the_openai_client_makes_groups_through_the_proxy(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    # Given a run with four guess-the-number prompts and a proxy serving its episodes
    settings = load_settings(run=run_name, redis={"url": redis_server.url}, tasks=[{"name": "agent", "n": N}])
    prompts = read_prompt_file(EXAMPLES / "guess.jsonl", "agent")[:GROUPS]
    open_buffer(redis.Redis.from_url(redis_server.url), settings, "feed").feed(prompts)
    port = free_port()
    env = {
        **os.environ,
        "ROLLSTREAM_RUN": run_name,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_TASKS": orjson.dumps([{"name": "agent", "n": N}]).decode(),
        "ROLLSTREAM_ENGINES__COUNT": "1",
        "ROLLSTREAM_ENGINES__SIM": orjson.dumps(
            {"time_compression": 200.0, "median_tokens": 12, "sigma": 0.3, "accuracy": 0.5}
        ).decode(),
        "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "4",
        "ROLLSTREAM_ROLLOUT__MAX_STALENESS": "4",
        "ROLLSTREAM_PRODUCER__IS_VALID": "keep_all",
        "ROLLSTREAM_PRODUCER__MAX_TURNS": "4",
        "ROLLSTREAM_PRODUCER__HEARTBEAT_S": "0.2",
    }
    proxy = ProducerProcess(env, tmp_path, "proxy", ("proxy", "--local-engines", "--port", str(port)))
    url = f"http://127.0.0.1:{port}"
    try:

        def serving() -> bool:
            proxy.running()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(serving, timeout=60, interval=0.1)

        # When the example agent plays every episode with the openai client
        agent = subprocess.run(
            [sys.executable, str(EXAMPLES / "proxy_agent.py"), "--proxy", url, "--episodes", str(GROUPS * N)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert agent.returncode == 0, agent.stderr[-2000:]
        assert f"played {GROUPS * N} episodes (0 aborted)" in agent.stdout

        # Then its groups are in the stream, each sample one whole conversation
        client = redis.Redis.from_url(redis_server.url)
        stream = Keys(run_name).groups("agent")
        wait_for(lambda: proxy.running() and client.xlen(stream) == GROUPS, timeout=30)
        entries = client.xrange(stream)
    finally:
        proxy.proc.send_signal(signal.SIGTERM)
        code, _, err = proxy.finish(timeout=60)
    assert code == 0, err[-2000:]
    assert "proxy serves episodes on" in err

    assert all(fields[b"format"] == b"1.1" for _, fields in entries)
    groups = [codec.decode_group(fields) for _, fields in entries]
    assert sorted(g.prompt.uid for g in groups) == sorted(p.uid for p in prompts)
    for group in groups:
        assert group.n == N
        secret = int(group.prompt.meta["answer"])
        # the chat prompt as the producer renders it for the byte tokenizer, encoded once
        prompt_ids = list(f"user: {group.prompt.prompt}\nassistant:".encode())
        for sample in group.samples:
            assert sample.prompt_ids.tolist() == prompt_ids
            roles = [t.role for t in sample.turns]
            assert roles[::2] == [MODEL] * len(roles[::2]) and roles[1::2] == [ENV] * len(roles[1::2])
            assert roles[-1] == MODEL and len(roles[::2]) <= 4
            assert sum(t.length for t in sample.turns) == len(sample.response_ids)
            mask = [int(t.role == MODEL) for t in sample.turns for _ in range(t.length)]
            assert sample.loss_mask.tolist() == mask
            assert all(t.text in ("\nuser: lower\nassistant:", "\nuser: higher\nassistant:")
                       for t in sample.turns if t.role == ENV)  # fmt: skip
            # the reward the agent reported: 1 when its last guess was right
            right = read_guess(sample.turns[-1].text) == secret
            assert sample.reward["score"] == (1.0 if right else 0.0)
            assert sample.agent_status == "done"
            # what the agent said is tokenised once, byte for byte (the byte tokenizer)
            start = 0
            for turn in sample.turns:
                ids = sample.response_ids[start : start + turn.length].tolist()
                if turn.role == ENV:
                    assert bytes(ids).decode() == turn.text
                start += turn.length


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require("transformers", "hf")
    from tests.hf_fixtures import save_model

    return save_model(tmp_path_factory.mktemp("tiny"), seed=3)


def test_the_proxy_on_the_hf_engine_stores_what_the_model_sampled(
    redis_server: EmbeddedRedis, run_name: str, tiny_model: Path
) -> None:
    """The same example agent against a producer with the hf engine in this process: each
    model turn is exactly what the engine sampled, given exactly the sequence before it;
    what the agent added is the chat template's framing, tokenised once."""
    from tests.integration.test_agent_runs import producer_for, record_generations

    producer = producer_for(
        redis_server.url,
        run_name,
        engines={"kind": "hf", "hf": {"model": str(tiny_model)}},
        producer={"agent": "proxy", "agent_options": {"port": 0}, "judge": ENV_RETURN, "max_tokens": 8},
    )
    made = record_generations(producer)
    hf = producer.runner.tokenizer.tokenizer  # type: ignore[attr-defined]
    producer.buffer.feed(read_prompt_file(EXAMPLES / "guess.jsonl", "agent")[:2])
    agent: Any = producer.runner.agent

    async def main() -> str:
        stop = asyncio.Event()
        run = asyncio.create_task(producer.run(stop))
        await wait_for_async(lambda: still_running(run) and agent.url, timeout=60)
        play = await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLES / "proxy_agent.py"), "--proxy", agent.url,
            "--episodes", "4", "--max-turns", "2", "--max-tokens", "8",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(play.communicate(), 120)
        assert play.returncode == 0, err.decode()[-2000:]
        client = producer.buffer.client
        await wait_for_async(
            lambda: still_running(run) and client.xlen(producer.buffer.keys.groups("agent")) == 2
        )
        stop.set()
        await asyncio.wait_for(run, 60)
        return out.decode()

    assert "played 4 episodes" in asyncio.run(main())
    groups = [
        codec.decode_group(f) for _, f in producer.buffer.client.xrange(producer.buffer.keys.groups("agent"))
    ]
    sampled = {tuple(ids) for _, ids in made}
    contexts = {tuple(context) for context, _ in made}
    for group in groups:
        for sample in group.samples:
            assert sample.prompt_ids.tolist() == producer.runner.tokenizer.encode(
                [{"role": "user", "content": group.prompt.prompt}]
            )
            start = 0
            for turn in sample.turns:
                ids = sample.response_ids[start : start + turn.length].tolist()
                if turn.role == MODEL:
                    assert tuple(ids) in sampled  # exactly what the engine sampled
                    assert (
                        tuple(sample.prompt_ids.tolist() + sample.response_ids[:start].tolist()) in contexts
                    )
                else:  # what the agent added, tokenised once, without special tokens
                    assert turn.role == ENV and ids == hf.encode(turn.text, add_special_tokens=False)
                start += turn.length
            assert [t.role for t in sample.turns] in ([MODEL], [MODEL, ENV, MODEL])
