"""Where engine actors run: the options Ray gets from the engines settings (GPUs, CPUs,
custom resources, node labels, spread / pack, a placement group per tensor-parallel
engine), and the settings errors. No cluster: the options themselves."""

from __future__ import annotations

import pytest
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollstream.producer.fleet.actors import (
    actor_options,
    describe_needs,
    engine_payload,
    placement_group_options,
)
from rollstream.shared.engine_settings import EngineSettings
from rollstream.shared.errors import SettingsError
from rollstream.shared.settings import load_settings


def engines(**values: object) -> EngineSettings:
    return load_settings(run="r", engines=values).engines


def test_by_default_an_engine_takes_one_cpu_and_rays_default_placement() -> None:
    options = actor_options(engines(), "r", 3, detached=True)
    assert options["name"] == "rollstream:r:engine:3"
    assert options["namespace"] == "rollstream-r"
    assert (options["num_cpus"], options["num_gpus"]) == (1.0, 0.0)
    assert options["lifetime"] == "detached"
    assert "scheduling_strategy" not in options
    assert "resources" not in options and "label_selector" not in options
    assert "lifetime" not in actor_options(engines(), "r", 3, detached=False)


def test_gpus_custom_resources_labels_and_spread_go_to_the_actor() -> None:
    settings = engines(
        num_gpus=1,
        num_cpus=4,
        resources={"rollout": 1},
        node_labels={"ray.io/accelerator-type": "H100", "zone": "!in(a,b)"},
        strategy="spread",
    )
    options = actor_options(settings, "r", 0, detached=True)
    assert (options["num_cpus"], options["num_gpus"]) == (4.0, 1.0)
    assert options["resources"] == {"rollout": 1.0}
    assert options["label_selector"] == {"ray.io/accelerator-type": "H100", "zone": "!in(a,b)"}
    assert options["scheduling_strategy"] == "SPREAD"
    assert describe_needs(settings) == (
        "4 CPU, 1 GPU, 1 rollout, label ray.io/accelerator-type=H100, label zone=!in(a,b)"
    )


def test_a_tensor_parallel_engine_reserves_its_gpus_on_one_node_in_a_placement_group() -> None:
    settings = engines(
        tensor_parallel_size=4, num_cpus=2, resources={"rollout": 1}, node_labels={"pool": "gen"}
    )
    group = placement_group_options(settings, "r", 1, detached=True)
    assert group["strategy"] == "STRICT_PACK"
    assert group["name"] == "rollstream:r:engine:1:pg"
    assert group["lifetime"] == "detached"
    assert group["bundles"] == [{"GPU": 1.0, "CPU": 2.0, "rollout": 1.0}] + [{"GPU": 1.0}] * 3
    assert group["bundle_label_selector"] == [{"pool": "gen"}] * 4
    assert settings.gpus_per_engine == 4
    assert "4 GPU on one node" in describe_needs(settings)

    pg = object()  # what ray.util.placement_group returned
    options = actor_options(settings, "r", 1, detached=True, group=pg)
    strategy = options["scheduling_strategy"]
    assert isinstance(strategy, PlacementGroupSchedulingStrategy)
    assert strategy.placement_group is pg
    assert strategy.placement_group_bundle_index == 0
    assert strategy.placement_group_capture_child_tasks  # the engine's ranks go in the group too
    assert options["num_gpus"] == 0  # the GPUs are the ranks', in the group's bundles
    assert options["resources"] == {"rollout": 1.0}  # taken from the first bundle
    assert "label_selector" not in options  # the bundles carry the labels


def test_spread_does_not_override_a_placement_group() -> None:
    settings = engines(tensor_parallel_size=2, strategy="spread")
    options = actor_options(settings, "r", 0, detached=False, group=object())
    assert isinstance(options["scheduling_strategy"], PlacementGroupSchedulingStrategy)
    assert "lifetime" not in placement_group_options(settings, "r", 0, detached=False)


def test_a_tensor_parallel_vllm_engine_runs_its_ranks_on_rays_executor() -> None:
    import orjson

    settings = engines(kind="vllm", tensor_parallel_size=2)
    extra = orjson.loads(engine_payload(settings))["vllm"]["extra_args"]
    assert extra == {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
    own = engines(
        kind="vllm", tensor_parallel_size=2, vllm={"extra_args": {"distributed_executor_backend": "mp"}}
    )
    assert orjson.loads(engine_payload(own))["vllm"]["extra_args"]["distributed_executor_backend"] == "mp"
    assert orjson.loads(engine_payload(engines(kind="vllm")))["vllm"]["extra_args"] == {}


@pytest.mark.parametrize(
    ("values", "named", "says"),
    [
        ({"tensor_parallel_size": 4, "num_gpus": 1}, "engines", "set num_gpus to 4"),
        ({"resources": {"GPU": 1}}, "engines.resources", "engines.num_gpus"),
        ({"resources": {"rollout": 0}}, "engines.resources", "amount > 0"),
        ({"node_labels": {"zone": "a b"}}, "engines.node_labels", "label selector"),
        ({"strategy": "scatter"}, "engines.strategy", "'spread' or 'pack'"),
        ({"tensor_parallel_size": 0}, "engines.tensor_parallel_size", ""),
    ],
)
def test_placement_settings_errors_name_the_setting(values: dict[str, object], named: str, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        engines(**values)
    assert f"invalid setting {named} " in str(caught.value)
    assert says in str(caught.value)


def test_placement_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ENGINES__STRATEGY", "spread")
    monkeypatch.setenv("ROLLSTREAM_ENGINES__RESOURCES", '{"rollout": 1}')
    monkeypatch.setenv("ROLLSTREAM_ENGINES__TENSOR_PARALLEL_SIZE", "2")
    settings = load_settings(run="r").engines
    assert (settings.strategy, settings.resources, settings.tensor_parallel_size) == (
        "spread",
        {"rollout": 1},
        2,
    )
