"""The ``algorithm`` settings block: the trainer's AlgorithmConfig, set like any other
setting (environment, rollstream.toml, keywords), with errors that name it."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from rollstream.consumer.advantages import ADVANTAGE_ESTIMATORS
from rollstream.consumer.losses import AGGREGATIONS, IMPORTANCE_CORRECTIONS, POLICY_LOSSES, AlgorithmConfig
from rollstream.shared.algorithm_settings import AdvantageEstimator, AlgorithmSettings
from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings


def test_the_consumer_config_is_the_settings_block() -> None:
    assert AlgorithmConfig is AlgorithmSettings
    assert load_settings().algorithm == AlgorithmConfig()
    assert get_args(AdvantageEstimator) == ADVANTAGE_ESTIMATORS == ("grpo", "dr_grpo", "rloo")
    assert POLICY_LOSSES == ("pg", "ppo", "decoupled_ppo")
    assert IMPORTANCE_CORRECTIONS == ("none", "tis", "masked_is")
    assert AGGREGATIONS == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def test_environment_and_file_set_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLSTREAM_ALGORITHM__LOSS", "decoupled_ppo")
    monkeypatch.setenv("ROLLSTREAM_ALGORITHM__ADV_EPS", "1e-4")
    (tmp_path / "rollstream.toml").write_text('[algorithm]\nimportance = "tis"\ntis_cap = 3.0\n')
    monkeypatch.chdir(tmp_path)
    algorithm = load_settings().algorithm
    assert (algorithm.loss, algorithm.adv_eps, algorithm.importance, algorithm.tis_cap) == (
        "decoupled_ppo", 1e-4, "tis", 3.0,
    )  # fmt: skip
    assert algorithm.needs_behaviour_logprobs and algorithm.needs_proximal_logprobs


def test_a_bad_value_names_the_setting_and_what_is_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ALGORITHM__LOSS", "grpo")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith("invalid setting algorithm.loss (ROLLSTREAM_ALGORITHM__LOSS):")
    assert "'pg', 'ppo' or 'decoupled_ppo'" in message and "got 'grpo'" in message


def test_an_inconsistent_choice_says_why() -> None:
    inconsistent = r"invalid setting algorithm \(keyword argument algorithm\): importance 'tis' corrects"
    with pytest.raises(SettingsError, match=inconsistent):
        load_settings(algorithm={"loss": "ppo", "importance": "tis"})
    with pytest.raises(SettingsError, match=r"did you mean algorithm\.tis_cap\?"):
        load_settings(algorithm={"tis_capp": 2.0})
