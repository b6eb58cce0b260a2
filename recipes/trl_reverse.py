"""TRL's GRPOTrainer on the reverse task (rollstream.recipes.reverse), alone or through
rollstream, with the same model, prompts, reward, algorithm and steps: what
bench/trl_rollstream.py compares.

- ``alone``: TRL generates in its own process (transformers' ``generate`` on the model it
  trains) and scores with ``reverse_reward``, the reverse judge's partial reward.
- ``rollstream``: TRL's ``rollout_func`` is rollstream's (consumer/integrations/trl.py):
  each generation goes to hf engines in Ray actors through producers and Redis streams,
  judged there by the same judge, and the weights go back to the engines after each step.

Both record, per step, TRL's logged mean reward and the wall seconds since training
began (model loaded; for rollstream, engines up), and the samples trained. TRL, datasets
and Ray are imported when a run starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.producer.judges.reverse import partial_reward, symbols
from rollstream.recipes import learning, reverse
from rollstream.shared.records import Prompt

log = logging.getLogger(__name__)

N = 8  # samples a prompt (num_generations = tasks[].n)
PROMPTS_PER_STEP = learning.PROMPTS_PER_STEP
EOS_ID = reverse.VOCAB.index(reverse.EOS)


@dataclass(slots=True)
class TrlRun:
    way: str
    rewards: list[float] = field(default_factory=list)  # TRL's logged mean reward, per step
    seconds: list[float] = field(default_factory=list)  # wall seconds from train begin, per step
    samples: int = 0  # completions trained on
    setup_s: float = 0.0  # before training begins: model, engines

    @property
    def wall_s(self) -> float:
        return self.seconds[-1] if self.seconds else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s else 0.0

    def seconds_to(self, target: float, window: int) -> float | None:
        step = reverse.steps_to(self.rewards, target, window)
        return None if step is None else self.seconds[step - 1]

    def summary(self, target: float, window: int) -> dict[str, Any]:
        return {
            "way": self.way,
            "steps": len(self.rewards),
            "samples": self.samples,
            "wall_s": self.wall_s,
            "setup_s": self.setup_s,
            "samples_per_s": self.samples_per_s,
            "steps_to_target": reverse.steps_to(self.rewards, target, window),
            "seconds_to_target": self.seconds_to(target, window),
            "reward_by_step": [round(r, 4) for r in self.rewards],
            "seconds_by_step": [round(s, 3) for s in self.seconds],
        }


def reverse_reward(
    completions: list[str], completion_ids: list[list[int]], answer: list[str], **_: Any
) -> list[float]:
    """The reverse judge's partial reward (producer/judges/reverse.py) of TRL's completions:
    the text's symbols against the answer's, and the end right when the model wrote its
    end-of-sequence token after exactly that many symbols."""
    return [
        partial_reward(symbols(want), symbols(text), EOS_ID in ids)
        for text, ids, want in zip(completions, completion_ids, answer, strict=True)
    ]


def training_prompts(seed: int, count: int) -> list[Prompt]:
    train, _ = reverse.all_prompts(seed)
    return learning.training_prompts(train, count, seed)


def _trainer(
    model_dir: Path, out_dir: Path, steps: int, seed: int, prompts: list[Prompt], run: TrlRun, **kwargs: Any
) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Record(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.began = time.monotonic()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "reward" in logs:
                run.rewards.append(float(logs["reward"]))
                run.seconds.append(time.monotonic() - self.began)
                run.samples += PROMPTS_PER_STEP * N

    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=PROMPTS_PER_STEP * N,
        num_generations=N,
        max_steps=steps,
        max_completion_length=reverse.MAX_TOKENS,
        temperature=1.0,
        learning_rate=reverse.LR,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=seed,
    )
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.meta["answer"]} for p in prompts])
    extra = kwargs.pop("callbacks", [])
    return GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=kwargs.pop("reward_funcs"),
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[*extra, Record()],
        **kwargs,
    )


def run_alone(work: Path, steps: int, seed: int = 0) -> TrlRun:
    """TRL alone: its own generation in this process."""
    started = time.monotonic()
    run = TrlRun("trl")
    model_dir = reverse.save_model(work / "model", seed)
    prompts = training_prompts(seed, steps * PROMPTS_PER_STEP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's about the vLLM beside it, transformers' generation notes
        trainer = _trainer(model_dir, work / "out", steps, seed, prompts, run, reward_funcs=reverse_reward)
        run.setup_s = time.monotonic() - started
        trainer.train()
    return run


def run_with_rollstream(redis_url: str, work: Path, steps: int, seed: int = 0, engines: int = 1) -> TrlRun:
    """TRL with rollstream's rollout function: hf engines in Ray actors of this process's
    (local) Ray, one producer in a thread, the reverse judge in the producer."""
    from rollstream.consumer.assembly import create_trl_rollout
    from rollstream.consumer.integrations.trl import rollstream_reward
    from rollstream.producer.fleet.pool import EnginePool
    from rollstream.producer.ray_signals import init_ray_keeping_signals

    started = time.monotonic()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    run = TrlRun("trl+rollstream")
    name = f"trl-reverse-{seed}-{int(time.time())}"
    model_dir = reverse.save_model(work / "model", seed)
    recipe = learning.RECIPES["sync"]
    settings = learning.learning_settings(recipe, redis_url, name, model_dir, engines=engines, n=N)
    prompts = training_prompts(seed, steps * PROMPTS_PER_STEP)
    init_ray_keeping_signals(local=True)
    pool = EnginePool.start(settings.run, settings.engines, detached=False)
    stop = threading.Event()
    producer = threading.Thread(target=_produce, args=(settings, pool, stop), name="producer", daemon=True)
    producer.start()
    try:
        rollout = create_trl_rollout(settings, catalog=prompts, weights_dir=str(work / "weights"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(
                model_dir, work / "out", steps, seed, prompts, run,
                reward_funcs=rollstream_reward, rollout_func=rollout, callbacks=[rollout.callback()],
            )  # fmt: skip
            run.setup_s = time.monotonic() - started
            trainer.train()
    finally:
        stop.set()
        producer.join(timeout=60)
        EnginePool.stop(settings.run, settings.engines.count)
    return run


def _produce(settings: Any, pool: Any, stop: threading.Event) -> None:
    """One producer on ``pool`` until ``stop`` is set (a thread of its own, its own loop)."""
    from rollstream.producer.assembly import build_producer
    from rollstream.shared.connection import connect

    async def main() -> None:
        producer = build_producer(
            connect(settings.redis), settings, pool=pool, name=f"{settings.run}-producer"
        )
        done = asyncio.Event()
        task = asyncio.create_task(producer.run(done))
        await asyncio.to_thread(stop.wait)
        done.set()
        await task

    try:
        asyncio.run(main())
    except Exception:
        log.exception("the producer failed")
