"""What the tests of the outside trainers' adapters (consumer/integrations/) run beside the
trainer: hf engines in Ray actors and one producer in a thread of this process, on a tiny
Llama built on the spot (tests/hf_fixtures.py) with a regex judge, so that rewards vary
within a group; and the engines' weights, tensor by tensor, as sha256 digests."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import redis

from rollstream.shared.records import Prompt
from rollstream.shared.settings import Settings, load_settings

TASK = "words"
WORDS = (
    "the cat sat on the mat",
    "a quick brown fox",
    "one two three four",
    "red green blue",
    "sun moon star",
)


def word_prompts(count: int) -> list[Prompt]:
    """Prompts whose judge rewards a response holding a word (the regex judge's pattern)."""
    out = []
    for i in range(count):
        text = f"{WORDS[i % len(WORDS)]} {i}"
        pattern = ("the", "dog", "two", "sun", "cat")[i % 5]
        out.append(Prompt(uid=f"p{i}", task=TASK, prompt=text, meta={"pattern": pattern}))
    return out


def pipeline_settings(
    url: str, run: str, model_dir: Path, weights_dir: Path, *, n: int, batch: int, mode: str = "sync"
) -> Settings:
    return load_settings(
        run=run,
        redis={"url": url},
        tasks=[{"name": TASK, "n": n}],
        engines={
            "kind": "hf",
            "count": 1,
            "num_cpus": 1,
            "max_restarts": 0,
            "hf": {"model": str(model_dir), "device": "cpu", "dtype": "float32"},
        },
        rollout={"mode": mode, "batch_size": batch, "max_staleness": 1, "sync_weights_interval": 1},
        producer={
            "judge": "regex",
            "is_valid": "keep_all",  # TRL needs a completion for every entry it asked for
            "max_tokens": 6,
            "temperature": 1.0,
            "max_inflight": 8,
            "heartbeat_s": 0.5,
            "group_timeout_s": 120.0,
        },
        buffer={"claim_idle_ms": 2000},
        weights={"kind": "file", "dir": str(weights_dir)},
    )


class Pipeline:
    """The run's engines (Ray actors of this process's local Ray) and one producer in a
    thread; ``stop`` ends both and raises what the producer raised."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="producer", daemon=True)
        self.pool: Any = None

    def start(self) -> Pipeline:
        from rollstream.producer.fleet.pool import EnginePool

        self.pool = EnginePool.start(self.settings.run, self.settings.engines, detached=False)
        self._thread.start()
        return self

    def check(self) -> bool:
        if self.error is not None:
            raise AssertionError(f"the producer crashed: {self.error!r}") from self.error
        return True

    def stop(self) -> None:
        from rollstream.producer.fleet.pool import EnginePool

        self._stop.set()
        self._thread.join(timeout=120)
        EnginePool.stop(self.settings.run, self.settings.engines.count)
        assert not self._thread.is_alive(), "the producer did not stop"
        self.check()

    def digests(self) -> list[dict[str, Any]]:
        """Each engine's model step and weight digests (EngineActor.weight_digests)."""
        import ray

        from rollstream.producer.engines.base import loads

        return [loads(ray.get(h.weight_digests.remote(), timeout=60)) for h in self.pool.handles]

    def _serve(self) -> None:
        from rollstream.producer.assembly import build_producer

        async def main() -> None:
            client = redis.Redis.from_url(self.settings.redis.url)
            producer = build_producer(client, self.settings, pool=self.pool, name=f"{self.settings.run}-p")
            done = asyncio.Event()
            task = asyncio.create_task(producer.run(done))
            stopping = asyncio.create_task(asyncio.to_thread(self._stop.wait))
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
            done.set()
            try:
                await task
            except BaseException as exc:
                self.error = exc

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc
