"""An engine as the pool shares it: the engine, plus what sharing one engine among
many producers needs — weight syncs done once per step however many producers ask,
and a drain that waits for every producer's requests, not one's.

The Ray actor wraps one of these; so does the in-process pool of one-process runs.
"""

from __future__ import annotations

import asyncio

from rollstream.producer.engines.base import Engine, EngineError, EngineHealth, Generation, SamplingParams


class StaleWeights(EngineError):
    """The engine holds older weights than the request needs: one that Ray restarted
    comes back at step 0 and must be brought to the run's step before it serves."""


class EngineHost:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_step = 0
        self.inflight = 0
        self._open = asyncio.Event()  # cleared while a drain waits for in-flight requests
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._sync = asyncio.Lock()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int, request_id: str, min_step: int = 0
    ) -> list[Generation]:
        await self._open.wait()
        if self.model_step < min_step:
            raise StaleWeights(f"holds model step {self.model_step}, the request needs {min_step}")
        self.inflight += 1
        self._idle.clear()
        try:
            return await self.engine.generate(prompt_ids, params, n, request_id)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def sync_weights(self, model_step: int, path: str | None, mode: str) -> int:
        """Move to ``model_step`` unless already there. Returns the engine's model step.

        drain: hold new requests until the running ones finish on the old weights.
        abort: abort the running ones (they return what they have; producers send
        their prompts back). partial: in place — pause decoding, load the weights,
        resume — so running requests keep their tokens and KV cache and go on with
        the new weights, their later tokens stamped with the new step. That is the
        partial rollout of the design without the round trip through the aborted
        pool: nothing is prefilled again, and a response keeps the length it was
        going to have (an abort with kept tokens is still how a producer hands a
        partial response on when it stops or gives up on an engine).
        """
        async with self._sync:
            if model_step <= self.model_step:
                return self.model_step
            paused = False
            try:
                # inside the try: a drain cancelled while it waits (the pool's sync timeout)
                # must open the engine again, or every later request waits for ever
                if mode == "drain":
                    self._open.clear()
                    await self._idle.wait()
                elif mode == "abort":
                    await self.engine.abort(None)
                if mode == "partial":
                    await self.engine.pause()
                    paused = True
                await self.engine.update_weights(model_step, path)
                self.model_step = model_step
            finally:
                if paused:
                    await self.engine.resume()
                self._open.set()
            return self.model_step

    async def abort(self, request_ids: list[str] | None) -> int:
        return await self.engine.abort(request_ids)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, model_step: int, path: str | None = None) -> None:
        await self.engine.update_weights(model_step, path)
        self.model_step = model_step

    async def health(self) -> EngineHealth:
        return await self.engine.health()
