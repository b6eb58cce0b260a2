"""A real Prometheus server scrapes a small formation run as processes (a producer on
local engines, the reference trainer, `rollstream metrics`), each serving on the $PORT a
process manager would give it; PromQL through Prometheus' HTTP API then finds the
trained groups rising, every trained group within the staleness bound, and no entry
pending once the run is over. Then the shipped Procfile under honcho: every process of
it scraped, the engines' figures among them. Prometheus is Debian's package (`make test`
installs it where it can): skipped where the binary is missing, failing in CI."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from honcho.environ import parse_procfile

from rollstream.shared.embedded import EmbeddedRedis, free_port
from tests.conftest import CI
from tests.helpers import wait_for
from tests.integration.test_procfile import BIN, ROOT, formation_env, process_env
from tests.unit.test_dashboard import DASHBOARD, queries

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 6
BATCH = 4
MAX_STALENESS = 1  # sync_weights_interval 1: a trained group is at most 1 step stale


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if CI:
            raise RuntimeError("no prometheus binary: CI installs Debian's package (make test does)")
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    return found


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


class Prometheus:
    """A Prometheus server of the test's own: its config, its data, its port."""

    def __init__(self, binary: str, tmp: Path, targets: dict[str, int], rules: Path | None = None) -> None:
        """One job per target; with ``rules``, a rule file evaluated every second."""
        self.port = free_port()
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
            for job, port in targets.items()
        )
        evaluated = "" if rules is None else f"  evaluation_interval: 1s\nrule_files: ['{rules}']\n"
        config = tmp / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n{evaluated}scrape_configs:\n{jobs}"
        )
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.jobs = set(targets)

    def ready(self) -> bool:
        """Serving queries and scraping every target (up or not yet): Prometheus applies
        its targets at its first discovery reload, some 5 s after it is ready, and a
        process started before that went unscraped for its first seconds (a 6-step
        trainer was seen at only two of its counts)."""
        assert self.proc.poll() is None, "prometheus exited: see prometheus.log"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                if reply.status != 200:
                    return False
            targets = get(f"{self.url}/api/v1/targets?state=active")["data"]["activeTargets"]
        except OSError:
            return False
        scraped = {t["labels"]["job"] for t in targets if not t["lastScrape"].startswith("0001-")}
        return scraped == self.jobs

    def query(self, promql: str) -> list[Any]:
        try:
            reply = get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
        except urllib.error.HTTPError as exc:  # a query Prometheus refuses: say which and why
            raise AssertionError(f"{promql}: {exc.read().decode()[:500]}") from None
        assert reply["status"] == "success", reply
        return list(reply["data"]["result"])

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def series(self, promql: str, start: float, end: float) -> list[float]:
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
        reply = get(f"{self.url}/api/v1/query_range?{urllib.parse.urlencode(params)}")
        assert reply["status"] == "success", reply
        (result,) = reply["data"]["result"]
        return [float(v) for _, v in result["values"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test starts; whatever is left at its end is killed (by handle)."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_prometheus_scrapes_a_formation_and_promql_sees_the_run(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    binary = prometheus_binary()
    ports = {"producer": free_port(), "trainer": free_port(), "metrics": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "RAY_ADDRESS", "PORT"))}
    env.update(
        ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_REDIS__URL=redis_server.url,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 2}]',
        ROLLSTREAM_ROLLOUT__BATCH_SIZE=str(BATCH),
        ROLLSTREAM_ROLLOUT__MAX_STALENESS=str(MAX_STALENESS),
        ROLLSTREAM_ENGINES__COUNT="2",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="20",
        ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="200",
        ROLLSTREAM_PRODUCER__IS_VALID="keep_all",
        ROLLSTREAM_PRODUCER__MAX_INFLIGHT="8",
        ROLLSTREAM_PRODUCER__HEARTBEAT_S="0.5",
    )
    prompts = tmp_path / "math.jsonl"
    prompts.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n' for i in range(200))
    )
    cli = [sys.executable, "-m", "rollstream.cli.main"]
    fed = subprocess.run(
        [*cli, "feed", str(prompts), "--task", "math"], env=env, capture_output=True, timeout=60
    )
    assert fed.returncode == 0, fed.stderr[-2000:]

    prometheus = Prometheus(binary, tmp_path, ports)
    logs = {role: (tmp_path / f"{role}.log").open("wb") for role in ports}
    try:
        wait_for(prometheus.ready, timeout=60)
        began = time.time()
        commands = {
            "metrics": ["metrics"],
            "producer": ["produce", "--local-engines"],
            "trainer": ["train", "--steps", str(STEPS), "--step-time", "1.0"],
        }
        procs = {}
        for role, args in commands.items():  # each on its own $PORT, as honcho and foreman give
            procs[role] = subprocess.Popen(
                [*cli, *args],
                env={**env, "PORT": str(ports[role])},
                stdout=logs[role],
                stderr=subprocess.STDOUT,
            )
            started.append(procs[role])
        said = lambda role: (tmp_path / f"{role}.log").read_text()[-3000:]  # noqa: E731

        # every process is scraped while it runs
        up = [f'max_over_time(up{{job="{job}"}}[5m])' for job in ports]
        wait_for(lambda: all(prometheus.scalar(query) == 1.0 for query in up), timeout=60)
        assert procs["trainer"].wait(timeout=240) == 0, said("trainer")
        # the producer stops (SIGTERM, as a process manager stops it): it hands its claims back
        procs["producer"].send_signal(signal.SIGTERM)
        assert procs["producer"].wait(timeout=60) == 0, said("producer")

        run = f'run="{run_name}"'
        pending = " + ".join(
            f"sum(rollstream_stream_{kind}_pending{{{run}}})" for kind in ("prompts", "aborted", "groups")
        )
        # pending back to 0 at the end, as the metrics process (still running) reads it ...
        wait_for(lambda: prometheus.scalar(pending) == 0.0, timeout=60)
        # ... after claims were pending while the run went on
        assert (prometheus.scalar(f"max_over_time(({pending})[5m:1s])") or 0) > 0
        ended = time.time()

        # trained groups rising, to the whole run's batches
        rising = prometheus.series(f"sum(rollstream_groups_trained_total{{{run}}})", began, ended)
        assert all(b >= a for a, b in itertools.pairwise(rising)), rising
        assert len(set(rising)) >= 3, f"not seen rising, only {sorted(set(rising))}"
        # the run-level counter the metrics process reads from Redis agrees
        assert prometheus.scalar(f"rollstream_progress_consumed_total{{{run}}}") == STEPS * BATCH
        assert prometheus.scalar(f"rollstream_train_step{{{run}}}") == STEPS

        # every trained group within the staleness bound: none above MAX_STALENESS
        total = prometheus.scalar(
            f"sum(last_over_time(rollstream_trained_group_staleness_count{{{run}}}[5m]))"
        )
        bound = f"{run},le='{float(MAX_STALENESS)}'"
        within = prometheus.scalar(
            f"sum(last_over_time(rollstream_trained_group_staleness_bucket{{{bound}}}[5m]))"
        )
        assert total and total >= (STEPS - 1) * BATCH  # the last step may end after the last scrape
        assert within == total
        tokens = f"sum(last_over_time(rollstream_generated_tokens_total{{{run}}}[5m]))"
        assert (prometheus.scalar(tokens) or 0) > 0

        # every query of the Grafana dashboard is valid PromQL on this run's series
        # (but the Redis panels': no exporter here, test_alerts_live.py runs them with one)
        dashboard = json.loads(DASHBOARD.read_text())
        ours = [expr for expr in queries(dashboard, variables=False) if "$redis" not in expr]
        empty = []
        for expr in ours:
            promql = expr.replace("$run", run_name).replace("$__rate_interval", "1m")
            if not prometheus.query(promql):
                empty.append(expr)
        # a run on sim engines without a policy has no KL, ratios or loss, no judge failures,
        # expiry, outages or engine actors (local engines); the rest shows
        assert len(empty) < len(ours) / 2, empty

        procs["metrics"].send_signal(signal.SIGTERM)
        assert procs["metrics"].wait(timeout=60) == 0, said("metrics")
    finally:
        prometheus.stop()
        for handle in logs.values():
            handle.close()


def formation_ports(base: int, concurrency: dict[str, int]) -> dict[str, int]:
    """honcho's $PORT of each process of the Procfile (``name.i``): base + 100 x its line's
    index + its instance, as honcho gives them."""
    names = list(parse_procfile((ROOT / "Procfile").read_text()).processes)
    return {
        f"{name}.{i + 1}": base + 100 * index + i
        for index, name in enumerate(names)
        for i in range(concurrency.get(name, 1))
    }


def free_base(concurrency: dict[str, int]) -> int:
    """A base port whose every formation port is free now."""
    for _ in range(50):
        base = random.randrange(20000, 60000, 100)
        ports = formation_ports(base, concurrency).values()
        if all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of ports for the formation")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_prometheus_scrapes_every_process_of_the_procfile(
    run_name: str, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """The shipped Procfile under honcho, on ports of its own: Prometheus scrapes every
    process (the engines' figures asked of the engine actors, the judge, the feeder), and
    PromQL sees the run train to its end within the staleness bound."""
    binary = prometheus_binary()
    concurrency = {"producer": 2}
    base = free_base(concurrency)
    ports = formation_ports(base, concurrency)
    del ports["redis.1"]  # redis-server serves no metrics
    values = formation_env(tmp_path, run_name)
    values.update(ROLLSTREAM_STEPS="8", ROLLSTREAM_TRAIN_ARGS="--step-time 1.0")
    env_file = tmp_path / "formation.env"
    env_file.write_text("".join(f"{k}='{v}'\n" for k, v in values.items()))
    env = {k: v for k, v in process_env(values).items() if k != "PORT"}
    prometheus = Prometheus(binary, tmp_path, {name.replace(".", "_"): port for name, port in ports.items()})
    try:
        wait_for(prometheus.ready, timeout=60)
        began = time.time()
        with (tmp_path / "honcho.log").open("wb") as log:
            honcho = subprocess.Popen(
                [str(BIN / "honcho"), "start", "-e", str(env_file), "-c", "producer=2", "-p", str(base)],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            started.append(honcho)
            assert honcho.wait(timeout=300) == 0, (tmp_path / "honcho.log").read_text()[-4000:]
        said = (tmp_path / "honcho.log").read_text()
        assert "metrics.1 stopped (rc=0)" in said, said[-4000:]
        ended = time.time()

        run = f'run="{run_name}"'
        for job in ports:  # every process was scraped
            up = prometheus.scalar(f'max_over_time(up{{job="{job.replace(".", "_")}"}}[10m])')
            assert up == 1.0, f"{job} was never scraped:\n{said[-3000:]}"
        engines_up = prometheus.scalar(f"max(last_over_time(rollstream_engine_up{{{run}}}[10m]))")
        assert engines_up == 1.0
        rising = prometheus.series(f"max(rollstream_progress_consumed_total{{{run}}})", began, ended)
        assert all(b >= a for a, b in itertools.pairwise(rising)), rising
        assert len(set(rising)) >= 3, f"not seen rising, only {sorted(set(rising))}"
        # the .env's bound (sync_weights_interval 1): no trained group staler than max_staleness
        bound = f"{run},le='{float(values['ROLLSTREAM_ROLLOUT__MAX_STALENESS'])}'"
        total = prometheus.scalar(
            f"sum(last_over_time(rollstream_trained_group_staleness_count{{{run}}}[10m]))"
        )
        within = prometheus.scalar(
            f"sum(last_over_time(rollstream_trained_group_staleness_bucket{{{bound}}}[10m]))"
        )
        assert total and within == total
        # the producers timed the judge queue's jobs, which the judge process ran
        judged = prometheus.scalar(f"sum(last_over_time(rollstream_judge_seconds_count{{{run}}}[10m]))")
        assert judged and judged > 0
    finally:
        prometheus.stop()
