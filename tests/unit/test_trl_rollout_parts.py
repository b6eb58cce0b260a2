"""The pure parts of rollstream's TRL GRPOTrainer adapter (consumer/integrations/trl.py): the
version check, the reward pass-through, TRL's prompts as rollstream prompts, and what the
rollout function returns from groups."""

from __future__ import annotations

import math
from typing import Any

import fakeredis
import pytest

from rollstream.consumer.assembly import create_coordinator
from rollstream.consumer.integrations.trl import (
    REWARD_KEY,
    STALENESS_KEY,
    RolloutPlan,
    TrlRollout,
    check_trl,
    completions,
    prompt_key,
    rollstream_reward,
)
from rollstream.consumer.weights import WeightPublisher
from rollstream.shared.errors import IntegrationError, UnsupportedVersion
from rollstream.shared.events import RunControl
from rollstream.shared.records import Group, Prompt, Sample
from rollstream.shared.transports import TransportSettings
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, require


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.0.dev0", "1.16.1rc2"])
def test_a_tested_trl_version_passes(version: str) -> None:
    assert check_trl(version) == version


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "0.29.0", "2.0", "main"])
def test_another_trl_version_is_refused_naming_both(version: str) -> None:
    with pytest.raises(UnsupportedVersion) as caught:
        check_trl(version)
    assert f"TRL {version} is installed" in str(caught.value)
    assert "trl>=1.16,<1.17" in str(caught.value)


def test_no_trl_installed_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(UnsupportedVersion, match=r"TRL is not installed: pip install 'rollstream\[trl\]'"):
        check_trl()


def test_the_reward_function_passes_the_judged_scores_through() -> None:
    got = rollstream_reward(["a", "b", "c"], prompts=["p"] * 3, **{REWARD_KEY: [1.0, None, 0.25]})
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == 0.25
    with pytest.raises(IntegrationError, match="no judged rewards"):
        rollstream_reward(["a"], prompts=["p"])
    with pytest.raises(IntegrationError, match="2 judged rewards for 1 completions"):
        rollstream_reward(["a"], **{REWARD_KEY: [1.0, 0.0]})


def _group(prompt: Prompt, n: int, step: int, masked: bool = False) -> Group:
    group = group_for(prompt, n=n, tokens=3, step=step)
    for i, sample in enumerate(group.samples):
        sample.response_ids = sample.response_ids + 10 * i  # each sample its own tokens
        if masked:
            group.samples[i] = Sample(
                sample.prompt_ids, sample.response_ids, sample.logprobs, sample.response_versions,
                "stop", sample.reward, loss_mask=[1, 0, 1],
            )  # fmt: skip
    return group


def test_one_completion_per_entry_from_the_groups() -> None:
    batch = prompts("words", 2)
    tagged = [Prompt(f"b7/{p.uid}", p.task, p.prompt) for p in batch]
    groups = [_group(tagged[1], n=4, step=2), _group(tagged[0], n=4, step=3)]  # any order

    out = completions(groups, "b7", batch, n=3, step=4)

    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == 6
    by_prompt = {g.prompt.uid: g for g in groups}
    for entry in range(6):
        group = by_prompt[f"b7/{batch[entry // 3].uid}"]
        sample = group.samples[entry % 3]  # the k-th entry of a prompt's block: its k-th sample
        assert out["completion_ids"][entry] == sample.response_ids.tolist()
        assert out["prompt_ids"][entry] == sample.prompt_ids.tolist()
        assert out["logprobs"][entry] == pytest.approx(sample.logprobs.tolist())
        assert out[REWARD_KEY][entry] == sample.score
    assert out[STALENESS_KEY] == [0, 0, 0, 1, 1, 1]  # step 4: groups of model steps 3 and 2
    assert "env_mask" not in out  # every token the model's: no mask for TRL


def test_an_agents_loss_mask_goes_to_trl_as_its_env_mask() -> None:
    batch = prompts("words", 1)
    group = _group(Prompt(f"b1/{batch[0].uid}", "words", batch[0].prompt), n=2, step=0, masked=True)
    assert completions([group], "b1", batch, n=2, step=1)["env_mask"] == [[1, 0, 1], [1, 0, 1]]


def test_groups_that_do_not_fit_the_entries_are_named() -> None:
    batch = prompts("words", 2)
    only = _group(Prompt(f"b1/{batch[0].uid}", "words", batch[0].prompt), n=2, step=0)
    with pytest.raises(IntegrationError, match=f"no group for prompt {batch[1].uid}"):
        completions([only], "b1", batch, n=2, step=1)
    with pytest.raises(IntegrationError, match="has 2 samples for 3 entries"):
        completions([only], "b1", batch[:1], n=3, step=1)


def test_a_chat_prompt_is_one_key_whatever_its_key_order() -> None:
    a = [{"role": "user", "content": "hi"}]
    b = [{"content": "hi", "role": "user"}]
    assert prompt_key(a) == prompt_key(b) != prompt_key("hi")


@pytest.fixture
def rollout(make_settings: SettingsFactory, tmp_path: Any) -> TrlRollout:
    require("trl", "trl", load=False)  # the adapter checks the installed version when it is built
    settings = make_settings(tasks=[{"name": "words", "n": 3}, {"name": "math", "n": 4}])
    client = fakeredis.FakeRedis()
    coordinator = create_coordinator(settings, client=client, consumer="trl")
    control = RunControl(client, coordinator.keys)
    publisher = WeightPublisher(control, TransportSettings(dir=str(tmp_path)), str(tmp_path), settings.run)
    plan = RolloutPlan("trl", "words", {"words": 3, "math": 4}, batch_size=2, stale_threshold=2)
    catalog = [Prompt("q17", "math", "2 + 2 =", meta={"answer": "4"})]
    return TrlRollout(coordinator, control, publisher, plan, catalog)


def test_trls_prompts_become_one_rollstream_prompt_per_block(rollout: TrlRollout) -> None:
    got = rollout.prompts_of(["a b"] * 3 + ["a b"] * 3, 3)  # one prompt twice in the batch: two groups
    assert got[0].uid != got[1].uid and [p.task for p in got] == ["words", "words"]
    assert got[0].prompt == "a b" and got[0].meta == {}


def test_the_catalog_names_a_prompts_task_and_meta(rollout: TrlRollout) -> None:
    with pytest.raises(IntegrationError, match=r"num_generations is 3 and task 'math' has n = 4"):
        rollout.prompts_of(["2 + 2 ="] * 3, 3)
    plan = rollout.plan
    rollout.plan = RolloutPlan(plan.name, plan.task, {"words": 4, "math": 4}, 2, 2)
    (known,) = rollout.prompts_of(["2 + 2 ="] * 4, 4)
    assert known.task == "math" and known.meta == {"answer": "4"} and known.uid.endswith("q17")


def test_prompts_that_are_not_blocks_or_too_many_are_refused(rollout: TrlRollout) -> None:
    with pytest.raises(IntegrationError, match="not blocks of num_generations 3"):
        rollout.prompts_of(["a"] * 4, 3)
    with pytest.raises(IntegrationError, match=r"prompts 0\.\.2 are not one prompt repeated"):
        rollout.prompts_of(["a", "a", "b"], 3)
    with pytest.raises(IntegrationError, match=r"3 prompts and rollout\.batch_size 2"):
        rollout.prompts_of(["a"] * 3 + ["b"] * 3 + ["c"] * 3, 3)


def _trainer(training: bool = True, processes: int = 1) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        model=SimpleNamespace(training=training),
        accelerator=SimpleNamespace(num_processes=processes),
        num_generations=3,
    )


def test_what_the_rollout_function_cannot_serve_is_refused_before_anything_is_fed(
    rollout: TrlRollout,
) -> None:
    with pytest.raises(IntegrationError, match="eval completions"):
        rollout(["a b"] * 3, _trainer(training=False))
    with pytest.raises(IntegrationError, match="one training process"):
        rollout(["a b"] * 3, _trainer(processes=2))
    rollout.in_flight = type("InFlight", (), {"batch_id": "trl-7"})()  # type: ignore[assignment]
    with pytest.raises(IntegrationError, match="batch trl-7 is not committed: give GRPOTrainer the callback"):
        rollout(["a b"] * 3, _trainer())
    assert rollout.client.keys("*:batch:*") == []  # nothing submitted
