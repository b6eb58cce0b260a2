"""consumer.evaluation: which steps evaluate, the sets' batches and prompts, and the
metrics under each set's name whatever the batch id; the trainer's hook."""

from __future__ import annotations

from typing import Any

from rollstream.consumer.evaluation import GREEDY, EvalSet, Evaluator
from rollstream.producer.group import SAMPLING_META
from rollstream.shared.records import Prompt


class FakeCoordinator:
    """Records what is submitted; finalizing answers the coordinator's metric names."""

    def __init__(self) -> None:
        self.submitted: dict[str, list[Prompt]] = {}

    def submit_batch(self, batch_id: str, prompts: list[Prompt], kind: str = "train") -> int:
        assert kind == "eval"
        self.submitted[batch_id] = prompts
        return len(prompts)

    def finalize_eval_batch(self, batch_id: str, timeout: float | None = None) -> dict[str, Any]:
        n = len(self.submitted[batch_id])
        return {
            "metrics": {
                f"eval/{batch_id}/finished_task_count": float(n),
                f"eval/{batch_id}/score/mean@8": 0.5 if batch_id.startswith("greedy") else 0.25,
            }
        }


class FakeControl:
    """A run whose producers are all on the step (no heartbeats: none to wait for)."""

    def producers(self, heartbeat_age_s: float) -> list[Any]:
        return []


def test_sets_are_submitted_each_eval_step_and_named_in_the_metrics() -> None:
    prompts = [Prompt(f"u{i}", "reverse", "a b c >", meta={"answer": "c b a"}) for i in range(3)]
    sampled = EvalSet("heldout", prompts)
    greedy = sampled.greedy("greedy", scoring="exact")
    assert all(p.meta == {"answer": "c b a", **GREEDY, "scoring": "exact"} for p in greedy.prompts)
    assert GREEDY == {SAMPLING_META: {"temperature": 0.0}}  # what the producer reads
    assert prompts[0].meta == {"answer": "c b a"}  # the originals are left alone
    coordinator = FakeCoordinator()
    evaluator = Evaluator(coordinator, [sampled, greedy], every=10)  # type: ignore[arg-type]
    assert [s for s in range(1, 31) if evaluator.due(s)] == [10, 20, 30]
    assert not Evaluator(coordinator, [sampled], every=0).due(10)  # type: ignore[arg-type]
    metrics = evaluator(20, FakeControl())  # type: ignore[arg-type]
    assert sorted(coordinator.submitted) == ["greedy.20", "heldout.20"]
    assert {k: v for k, v in metrics.items() if k != "eval/seconds"} == {
        "eval/heldout/finished_task_count": 3.0,
        "eval/heldout/score/mean@8": 0.25,
        "eval/greedy/finished_task_count": 3.0,
        "eval/greedy/score/mean@8": 0.5,
    }
    assert metrics["eval/seconds"] >= 0
