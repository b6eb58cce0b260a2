"""deploy/k8s run as a cluster would run it (`make k8s-check`): every pod of config.yaml,
redis-acl.yaml, redis.yaml, ray-cluster.yaml, processes.yaml and trainer-job.yaml on an emulated host of
its own (chaos/k8s_pods.py over chaos/hosts.py: its own address, network, PID and mount
namespaces), with the command line, environment (envFrom, env, the Secret's keys, the
kubelet's Service variables), user (runAsUser, runAsGroup, fsGroup) and volumes that the
manifests give it, the Services' names resolving to their pods, the RayCluster's head and
worker started with KubeRay's `ray start` command line. A short run to its end: the
trainer Job and every other Job exit 0, the producers too, `rollstream status` (exec'd in
the metrics pod) finds nothing lost; the metrics Deployment's pod, started again after
the stop as a Deployment does, serves the run's figures; a producer started again exits
0 at once; the volumes hold what the pods' users wrote; everything is torn down.

What differs from the manifests, each because of this machine (no GPU, no model, a
short run), as ConfigMap entries or command lines the test gives:

- ``ROLLSTREAM_ENGINES__KIND=sim`` (vLLM needs GPUs): the simulated engines, at 50x
  (``ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION=50``, ``..._SIM__MEDIAN_TOKENS=50``);
  the count (4), tensor parallelism (2 GPUs an engine), ``rollout`` resource and spread
  placement are the manifests': Ray takes the worker's ``--num-gpus=8`` as given;
- the trainer's command line without ``--hf-model /models/policy`` (a real model on
  GPUs; the simulated engines serve none) and with ``--steps 3``, not 1000;
- ``ROLLSTREAM_ROLLOUT__BATCH_SIZE=8`` and ``ROLLSTREAM_PROCESS__STOP_TIMEOUT_S=10``;
- the GPU worker group scaled to 1 replica (2 in the manifest);
- the Secrets' ``change-me`` placeholders: fresh random values; the prompts claim: 64
  prompts of a test's own;
- the Redis exporter's container (``oliver006/redis_exporter``, an image this machine has
  no stand-in for) is not started; Redis's containers run the machine's redis-server.

Needs root, iproute2 and util-linux (setpriv, nsenter, unshare): skipped elsewhere, a
failure in CI."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import orjson
import pytest

from chaos import k8s_manifests
from chaos.hosts import unavailable
from chaos.k8s_pods import K8S, PodRun, manifest_paths, trainer_command
from tests.helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(900)]

STEPS = 3
OVERRIDES = {
    "ROLLSTREAM_ENGINES__KIND": "sim",
    "ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION": "50",
    "ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS": "50",
    "ROLLSTREAM_ROLLOUT__BATCH_SIZE": "8",
    "ROLLSTREAM_PROCESS__STOP_TIMEOUT_S": "10",
}
REPLICAS = {"rollstream-ray/gpu": 1}
RUN_BUDGET_S = 480  # the run to its end; about a minute on an idle 2-core machine
STATUS = ["rollstream", "status", "--json"]


def _require() -> None:
    reason = unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the Kubernetes check: {reason}")
        pytest.skip(reason)


def _prompts(path: Path, count: int) -> None:
    rows = (
        orjson.dumps({"uid": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)})
        for i in range(count)
    )
    path.write_bytes(b"\n".join(rows) + b"\n")


def _layout(paths: list[Path], settings: dict[str, str] | None = None) -> k8s_manifests.Layout:
    layout = k8s_manifests.load(paths, settings={**OVERRIDES, **(settings or {})}, replicas=REPLICAS)
    layout.pod("rollstream-trainer").command = trainer_command(layout, STEPS)
    assert "--hf-model" not in layout.pod("rollstream-trainer").command
    return layout


def _run_to_its_end(pods: PodRun) -> tuple[list[str], list[str]]:
    """Every Job and both producers exit 0 (a failure shows at once), every pod's liveness
    probe having answered once while it ran: the Jobs' and the producers' names."""
    layout = pods.layout
    jobs = [p.name for p in layout.pods if p.is_job]
    producers = [p.name for p in layout.of("rollstream-producer")]
    assert len(producers) == 2 and {"rollstream-engines", "rollstream-feeder", "rollstream-trainer"} <= set(
        jobs
    )
    ours = [p.name for p in layout.pods if p.liveness]  # the rollstream pods and Redis
    probed: set[str] = set()

    def over() -> bool:
        exits = pods.poll()
        failed = {n: c for n, c in exits.items() if c != 0}
        assert not failed, {n: (c, pods.log(n)) for n, c in failed.items()}
        # each liveness probe answers while its pod runs (the metrics port is the
        # containerPort the probe names): once is enough
        for name in ours:
            if name not in probed and name not in exits and pods.alive(name, timeout=2):
                probed.add(name)
        return all(n in exits for n in [*jobs, *producers])

    try:
        wait_for(over, timeout=RUN_BUDGET_S, interval=1.0)
    except AssertionError as exc:
        running = [n for n in [*jobs, *producers] if n not in pods.poll()]
        raise AssertionError(f"{exc}; still running: { ({n: pods.log(n, 1500) for n in running}) }") from None
    assert probed == set(ours), f"liveness never answered: {set(ours) - probed}"
    assert all(pods.exits[n] == 0 for n in [*jobs, *producers]), pods.exits
    engines_log = pods.log("rollstream-engines", 100_000)
    assert "4 sim engines ready" in engines_log and "ray://rollstream-ray-head-svc:10001" in engines_log
    return jobs, producers


def _status_in_the_metrics_pod(pods: PodRun) -> str:
    """The metrics Deployment's pod, started again as a Deployment does (it exits 0 at the
    stop), serves the run's final figures; `kubectl exec ... rollstream status` there finds
    the steps trained and nothing lost. The pod's name."""
    metrics = "rollstream-metrics-0"
    pods.poll()
    if metrics in pods.exits:
        pods.launch(pods.layout.pod(metrics))
    assert wait_for(lambda: pods.alive(metrics), timeout=120, interval=1.0), pods.log(metrics)
    assert pods.ready(metrics)  # its readiness probe: `rollstream check`
    status = pods.exec(metrics, STATUS)
    assert status.returncode == 0, status.stderr[-3000:]
    report = orjson.loads(status.stdout)
    assert report["train_step"] == STEPS
    (account,) = report["accounts"].values()
    assert account["trained"] >= STEPS and account["lost"] == 0, account
    assert report["lost"] is None
    return metrics


def test_the_kubernetes_manifests_run_a_short_run_to_its_end(tmp_path: Path) -> None:
    _require()
    layout = _layout(manifest_paths())
    pods = PodRun(layout, tmp_path / "pods")
    _prompts(pods.claim("rollstream-prompts") / "prompts.jsonl", 64)
    started = time.monotonic()
    try:
        pods.start()
        _, producers = _run_to_its_end(pods)
        run_s = time.monotonic() - started
        assert pods.ready("rollstream-redis-0")  # its readiness probe: redis-cli ping with the password
        metrics = _status_in_the_metrics_pod(pods)

        # a producer started again on the stopped run (the Deployment's restart) exits 0 at once
        again = pods.launch(layout.pod(producers[0]))
        assert again.wait(timeout=120) == 0, pods.log(producers[0])

        # what the pods' users wrote on their volumes, as fsGroup lets them
        state = pods.claim("rollstream-trainer-state") / "trainer.json"
        assert state.exists() and state.stat().st_uid == 1000 and state.stat().st_gid == 1000
        redis_files = list(pods.claim("data-rollstream-redis-0").rglob("*"))
        assert redis_files and all(f.stat().st_uid == 999 for f in redis_files)

        # the kubelet's stop: SIGTERM, exit 0 (the metrics pod still serving until then)
        assert pods.procs[metrics].poll() is None, pods.log(metrics)
        assert pods.terminate(metrics, grace=60) == 0, pods.log(metrics)
        assert pods.terminate("rollstream-redis-0", grace=60) == 0, pods.log("rollstream-redis-0")
        print(f"k8s run: {run_s:.0f} s to the end of the run, {time.monotonic() - started:.0f} s in all; "
              f"Jobs' failed pods made again: {({n: f for n, f in pods.failures.items() if f})}")  # fmt: skip
    finally:
        pods.close()
    assert not pods.work.exists()


def _readme_sed() -> tuple[str, str]:
    """k8s/README.md's Sentinel URL and its sed's pattern, as Python's re takes them: the
    shell's double quotes undone (``\\$`` is ``$``), then sed's basic regular expression
    (``\\(...\\)`` a group, a bare parenthesis or ``$`` mid-pattern a character)."""
    readme = (K8S / "README.md").read_text()
    url = re.search(r"^ROLLSTREAM_REDIS__URL='([^']+)'", readme, re.M)
    sed = re.search(r'sed "s\|(.+?)\|\$ROLLSTREAM_REDIS__URL\|"', readme)
    assert url and sed, "k8s/README.md's failover URL and its sed"
    bre, out, i = sed.group(1).replace("\\$", "$"), "", 0
    while i < len(bre):
        if bre[i] == "\\" and i + 1 < len(bre):
            out += bre[i + 1] if bre[i + 1] in "()" else re.escape(bre[i + 1])
            i += 2
            continue
        out += re.escape(bre[i]) if bre[i] in "()$+?{}|" else bre[i]
        i += 1
    return out, url.group(1)


def test_the_failover_redis_runs_with_the_sentinels_url(tmp_path: Path) -> None:
    """k8s/README.md's "Redis with failover", followed: ha/redis-ha.yaml instead of
    redis.yaml (three pods, a data node and a Sentinel each), the README's Sentinel URL
    put in processes.yaml and trainer-job.yaml in place of the plain one (its own sed),
    ROLLSTREAM_REDIS__WAIT_REPLICAS 2 in the ConfigMap. The run ends as with one Redis,
    pod 0 the primary with both replicas, every Sentinel naming it. The judge's Job
    with them: it once hung at the run's stop with the Sentinels' URL (a connection
    kept after a read cut short: shared/redis_sentinel.py)."""
    _require()
    pattern, url = _readme_sed()
    for name in ("processes.yaml", "trainer-job.yaml"):
        text, count = re.subn(pattern, url, (K8S / name).read_text())
        assert count >= 1, name
        (tmp_path / name).write_text(text)
    paths = [K8S / "config.yaml", K8S / "redis-acl.yaml", K8S / "ha" / "redis-ha.yaml",
             K8S / "ray-cluster.yaml",
             tmp_path / "processes.yaml", tmp_path / "trainer-job.yaml"]  # fmt: skip
    layout = _layout(paths, {"ROLLSTREAM_REDIS__WAIT_REPLICAS": "2"})
    redis_pods = [p.name for p in layout.pods if p.owner == "rollstream-redis-ha"]
    assert len(redis_pods) == 6  # three pods, two containers each
    pods = PodRun(layout, tmp_path / "pods")
    _prompts(pods.claim("rollstream-prompts") / "prompts.jsonl", 64)
    started = time.monotonic()
    try:
        pods.start()
        _run_to_its_end(pods)
        run_s = time.monotonic() - started
        assert all(pods.ready(n) for n in redis_pods)  # redis-cli ping, the data nodes' and Sentinels'
        _status_in_the_metrics_pod(pods)
        primary = "rollstream-redis-ha-0.rollstream-redis-ha.rollstream.svc"
        for i in range(3):
            ask = ["redis-cli", "-p", "26379", "sentinel", "get-master-addr-by-name", "rollstream-redis"]
            named = pods.exec(f"rollstream-redis-ha-{i}:sentinel", ask)
            assert named.stdout.split()[:1] == [primary], (named.stdout, named.stderr)
        admin = layout.secrets["rollstream-redis-users"]["REDIS_PASSWORD_ADMIN"]
        ask = ["env", f"REDISCLI_AUTH={admin}", "redis-cli", "--user", "admin", "info", "replication"]
        replication = pods.exec("rollstream-redis-ha-0", ask).stdout
        assert "role:master" in replication and "connected_slaves:2" in replication, replication
        for i in range(3):
            files = list(pods.claim(f"data-rollstream-redis-ha-{i}").rglob("*"))
            assert files and all(f.stat().st_uid == 999 for f in files)
        print(f"k8s run with failover Redis: {run_s:.0f} s to the end of the run; "
              f"Jobs' failed pods made again: {({n: f for n, f in pods.failures.items() if f})}")  # fmt: skip
    finally:
        pods.close()
