"""rollstream.recipes.learning without running anything: the recipes' settings, the feed of
training prompts, steps and seconds to a target reward."""

from __future__ import annotations

from pathlib import Path

from rollstream.cli.parser import RECIPE_NAMES
from rollstream.recipes import learning, reverse


def test_the_cli_offers_every_recipe() -> None:
    assert tuple(learning.RECIPES) == RECIPE_NAMES


def test_recipes_set_rollout_and_algorithm(tmp_path: Path) -> None:
    sync = learning.learning_settings(learning.RECIPES["sync"], "redis://127.0.0.1:1/0", "r", tmp_path)
    assert (sync.rollout.mode, sync.rollout.stale_threshold, sync.rollout.batch_size) == ("sync", 1, 8)
    assert (sync.tasks[0].name, sync.tasks[0].n, sync.producer.judge) == ("reverse", 8, "reverse")
    assert (sync.engines.kind, sync.engines.hf.model, sync.producer.max_tokens) == ("hf", str(tmp_path), 4)
    assert sync.algorithm == reverse.ALGORITHM and sync.algorithm.adv_eps == 1e-4
    decoupled = learning.learning_settings(
        learning.RECIPES["async_decoupled"], "redis://h:1/0", "r", tmp_path
    )
    assert (decoupled.rollout.mode, decoupled.rollout.max_staleness, decoupled.rollout.on_weight_sync) == (
        "async", 2, "partial",
    )  # fmt: skip
    assert decoupled.algorithm.loss == "decoupled_ppo" and decoupled.algorithm.needs_behaviour_logprobs
    assert learning.RECIPES["async_tis"].algorithm.importance == "tis"
    assert learning.RECIPES["async"].describe() == "async, max_staleness 2, partial sync, no correction"
    assert learning.RECIPES["async_tis"].describe() == "async, max_staleness 2, partial sync, tis (cap 2)"


def test_training_prompts_cycle_through_epochs_with_unique_uids() -> None:
    train, _ = reverse.all_prompts(0)
    fed = learning.training_prompts(train, len(train) + 5, seed=0)
    assert len(fed) == len({p.uid for p in fed}) == len(train) + 5
    assert {p.uid.rsplit(".", 1)[0] for p in fed[: len(train)]} == {p.uid for p in train}
    assert all(p.uid.endswith(".1") for p in fed[len(train) :])
    assert learning.training_prompts(train, 10, seed=0) == fed[:10]  # the seed decides


def test_steps_and_seconds_to_the_target() -> None:
    rewards = [0.1, 0.5, 0.9, 1.0, 0.95, 0.9]
    # steps 2-4: (0.5 + 0.9 + 1.0) / 3 = 0.8; steps 3-5: (0.9 + 1.0 + 0.95) / 3 = 0.95
    assert reverse.steps_to(rewards, 0.9, window=3) == 5
    assert reverse.steps_to(rewards, 0.99, window=3) is None
    assert reverse.steps_to([0.95], 0.9, window=10) == 1  # fewer steps than the window: all of them
    settings = learning.learning_settings(learning.RECIPES["sync"], "redis://h:1/0", "r", Path("m"))
    result = learning.LearnResult("sync", 0, settings)
    result.steps = [learning.StepRecord(i + 1, r, 0.5 * (i + 1), {0: 8}) for i, r in enumerate(rewards)]
    assert (result.steps_to(0.9, 3), result.seconds_to(0.9, 3)) == (5, 2.5)
    summary = result.summary()
    assert summary["reward_by_step"] == rewards and summary["eval_accuracy"] is None


def test_the_real_model_task_runs_through_the_same_recipes() -> None:
    # issue 34: the arithmetic task on smollm2-135m, by name, with the math judge
    from rollstream.recipes import arithmetic
    from rollstream.recipes.tasks import ARITHMETIC, TASKS

    settings = learning.learning_settings(
        learning.RECIPES["async"], "redis://h:1/0", "r", ARITHMETIC.model(Path("unused"), 0), task=ARITHMETIC
    )
    assert [t.name for t in settings.tasks] == [arithmetic.TASK] and TASKS[arithmetic.TASK] is ARITHMETIC
    assert settings.engines.kind == "hf" and settings.engines.hf.model == "smollm2-135m"
    assert settings.producer.judge == "math" and settings.producer.max_tokens == arithmetic.MAX_TOKENS
    assert settings.rollout.mode == "async"
    train, held_out = ARITHMETIC.prompts(0)
    assert len(held_out) == ARITHMETIC.eval_prompts >= 200 and not ARITHMETIC.sampled_eval
    assert not {p.uid for p in train} & {p.uid for p in held_out}
    # its step in micro-batches (bounded memory, the same update); a recipe's own size stays
    assert settings.algorithm.micro_batch_size == ARITHMETIC.micro_batch_size == 16
    recipe = learning.RECIPES["async"].algorithm
    assert settings.algorithm.model_copy(update={"micro_batch_size": 0}) == recipe
    own = recipe.model_copy(update={"micro_batch_size": 4})
    assert ARITHMETIC.algorithm(own).micro_batch_size == 4


def test_the_reverse_task_trains_the_whole_batch_in_one_pass(tmp_path: Path) -> None:
    sync = learning.learning_settings(learning.RECIPES["sync"], "redis://h:1/0", "r", tmp_path)
    assert sync.algorithm.micro_batch_size == 0
