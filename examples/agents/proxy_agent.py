"""A proxy-driven agent: guess-the-number written against the OpenAI Python client, as
any agent framework would write it, trained through `rollstream proxy`.

It takes an episode from the proxy, talks to the run's engines through the episode's
`base_url` with `openai.OpenAI`, plays the game (GuessNumber's rules: `higher`,
`lower`, `correct`), and reports the episode's reward. The proxy records the tokens
of every call and writes each group of episodes to the run's stream.

    rollstream proxy --port 8642 &              # a producer serving episodes
    python examples/agents/proxy_agent.py --proxy http://127.0.0.1:8642 --episodes 64

Several of these may run at once, on any machine that reaches the proxy.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from types import SimpleNamespace
from typing import Any

import httpx
import openai

from rollstream.producer.agents.examples import GuessNumber

log = logging.getLogger("proxy_agent")


def play(client: openai.OpenAI, episode: dict[str, Any], max_turns: int, max_tokens: int) -> float:
    """One game: the model guesses, the game answers, until it is right or out of turns."""
    game = GuessNumber()
    game.reset(SimpleNamespace(meta=episode["meta"]))
    prompt = episode["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    reward = 0.0
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        observation, turn_reward, done = game.step(text)
        reward += turn_reward
        messages.append({"role": "assistant", "content": text})
        if done:
            break
        messages.append({"role": "user", "content": observation})
    return reward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:8642", help="the proxy's URL")
    parser.add_argument("--episodes", type=int, default=16, help="episodes to play, then exit")
    parser.add_argument("--max-turns", type=int, default=4, help="guesses per game")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per model turn")
    parser.add_argument("--idle-s", type=float, default=60.0, help="exit after this long without an episode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    played = aborted = 0
    idle_since = time.monotonic()
    with httpx.Client(timeout=120.0) as http:
        while played < args.episodes:
            answer = http.post(f"{args.proxy}/episodes", json={"wait_s": 5})
            answer.raise_for_status()
            if answer.status_code == 204:  # no group claimed yet (admission, or no prompts)
                if time.monotonic() - idle_since > args.idle_s:
                    log.warning("no episode for %.0f s: stopping after %d", args.idle_s, played)
                    break
                continue
            idle_since = time.monotonic()
            episode = answer.json()
            client = openai.OpenAI(base_url=episode["base_url"], api_key="unused", max_retries=0)
            try:
                reward = play(client, episode, args.max_turns, args.max_tokens)
            except openai.ConflictError as exc:  # its group was aborted (a pause, a stop, a sync)
                aborted += 1
                log.info("episode %s aborted: %s", episode["episode_id"], exc)
                continue
            http.post(f"{args.proxy}/episodes/{episode['episode_id']}/reward", json={"reward": reward})
            played += 1
            log.info("episode %s: reward %.1f", episode["episode_id"], reward)
    print(f"played {played} episodes ({aborted} aborted)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
