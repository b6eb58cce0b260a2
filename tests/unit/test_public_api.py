"""The trainer-side API the README shows is what `consumer` exports, with the
signatures the README uses: a change to either is a change to both."""

from __future__ import annotations

import inspect
from pathlib import Path

import consumer

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_consumer_exports_what_a_trainer_uses() -> None:
    names = ["BatchCoordinator", "BatchReader", "SyncTimeout", "TrainBatch"]
    assert sorted(consumer.__all__) == [*names, "publish_weights", "wait_for_producers"]
    for name in consumer.__all__:
        assert getattr(consumer, name) is not None


def test_the_signatures_the_readme_shows() -> None:
    assert list(inspect.signature(consumer.BatchReader.get_batch).parameters)[:2] == ["self", "train_step"]
    assert list(inspect.signature(consumer.publish_weights).parameters) == ["control", "model_step", "uri"]
    assert list(inspect.signature(consumer.TrainBatch.commit).parameters) == ["self"]
    coordinator = consumer.BatchCoordinator
    for method in ("submit_batch", "finalize_train_batch", "finalize_eval_batch", "abort_batch"):
        assert callable(getattr(coordinator, method)) and f"`{method}`" in README
    for shown in (
        "`BatchReader.get_batch(step)`",
        "`batch.commit()`",
        "`publish_weights(control, step, uri)`",
    ):
        assert shown in README
