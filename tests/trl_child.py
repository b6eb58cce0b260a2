"""TRL's GRPOTrainer on rollstream's rollout function, built the same way in the test process
and as a process of its own, which tests/integration/test_trl_grpo.py kills by its PID and
starts again from TRL's checkpoint:

    python -m tests.trl_child RUN_DIR [--resume] [--pause-after STEP]

RUN_DIR holds run.json (the settings, the prompts, the model directory, the steps) and
gets handed.jsonl: one line per generation handed to TRL, written before TRL trains on
it ({"pid", "batch", "groups", "global_step"}), and TRL's checkpoints under out/.
``--pause-after STEP`` pauses the run (`rollstream pause`) once TRL's step STEP is done
and published: the producers then leave the next batch unmade, and the process waits in
its rollout function, a batch in flight, for whoever kills it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollstream.consumer import create_trl_rollout, rollstream_reward
from rollstream.consumer.integrations.trl import TrlRollout
from rollstream.shared.records import Prompt
from rollstream.shared.settings import Settings

PER_STEP = 2  # prompts of one generation (rollout.batch_size)


def write_run(
    run_dir: Path, settings: Settings, prompts: list[Prompt], model_dir: Path, steps: int, save_steps: int
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "settings": json.loads(settings.model_dump_json()),
        "prompts": [{"uid": p.uid, "task": p.task, "prompt": p.prompt, "meta": p.meta} for p in prompts],
        "model": str(model_dir),
        "steps": steps,
        "save_steps": save_steps,
    }
    (run_dir / "run.json").write_text(json.dumps(spec))


def build(run_dir: Path, callbacks: tuple[Any, ...] = ()) -> tuple[Any, TrlRollout]:
    """The trainer of RUN_DIR's run and its rollout function (TRL's warnings about the vLLM
    beside it and its experimental rollout_func are silenced: they are TRL's)."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    spec = json.loads((run_dir / "run.json").read_text())
    settings = Settings.model_validate(spec["settings"])
    prompts = [Prompt(**p) for p in spec["prompts"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        rollout = create_trl_rollout(settings, catalog=prompts, timeout_s=600)
        n = settings.tasks[0].n
        args = GRPOConfig(
            output_dir=str(run_dir / "out"),
            per_device_train_batch_size=PER_STEP * n,
            num_generations=n,
            max_steps=spec["steps"],
            max_completion_length=settings.producer.max_tokens,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="steps",
            save_steps=spec["save_steps"],
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        model = AutoModelForCausalLM.from_pretrained(spec["model"])
        trainer = GRPOTrainer(
            model,
            reward_funcs=rollstream_reward,
            args=args,
            train_dataset=Dataset.from_list([{"prompt": p.prompt} for p in prompts]),
            processing_class=AutoTokenizer.from_pretrained(spec["model"]),
            rollout_func=logged(rollout, run_dir / "handed.jsonl"),
            callbacks=[rollout.callback(), *callbacks],
        )
    return trainer, rollout


def logged(rollout: TrlRollout, path: Path) -> Callable[[list[Any], Any], dict[str, list[Any]]]:
    """The rollout function, each generation it hands TRL written down first."""

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = rollout(prompts, trainer)
        assert rollout.in_flight is not None
        line = {
            "pid": os.getpid(),
            "batch": rollout.in_flight.batch_id,
            "groups": [g.group_id for g in rollout.last_groups],
            "global_step": int(trainer.state.global_step),
        }
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return out

    return rollout_func


def pauser(after: int) -> Any:
    """A TrainerCallback that pauses the run once TRL's step ``after`` is done."""
    from transformers import TrainerCallback

    from rollstream.shared.events import PAUSE

    class Pause(TrainerCallback):
        def __init__(self) -> None:
            self.rollout: TrlRollout | None = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == after and self.rollout is not None:
                self.rollout.control.publish(PAUSE)

    return Pause()


def train(run_dir: Path, resume: bool, pause_after: int | None) -> None:
    pause = pauser(pause_after) if pause_after is not None else None
    trainer, rollout = build(run_dir, callbacks=() if pause is None else (pause,))
    if pause is not None:
        pause.rollout = rollout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=True if resume else None)


if __name__ == "__main__":
    argv = sys.argv[1:]
    after = int(argv[argv.index("--pause-after") + 1]) if "--pause-after" in argv else None
    train(Path(argv[0]), "--resume" in argv, after)
