"""The alerting path as an SRE runs it: a real Prometheus evaluates rules and sends what
fires to a real Alertmanager, which routes it with the shipped config
(deploy/alertmanager/alertmanager.yml) to webhook receivers that this test serves. Pages
reach the page receiver, tickets the ticket one, and while a run's Redis is down
(RollstreamRunDown) that run's other alerts are held back, not those of another run.

The rules here fire at once (`vector(1)` with the labels the shipped rules give) or, for
the stalled trainers, once this test says so (a gauge it serves, which Prometheus
scrapes): the trainers stall after the Alertmanager holds r2's RunDown, as in a run.
Alertmanager inhibits by the source alerts it holds when a group's notice is due, and a
target that arrives with its source may come too late for it; a fixed `for:` of 5 s
was that order's only guard, and on a loaded machine Prometheus found the Alertmanager
after both had fired and sent them together. The rules are made up here since
promtool's unit tests already cover when the shipped rules fire; the Alertmanager config
is the shipped one with its receivers pointed at this test and its group_wait shortened.
Debian's prometheus and prometheus-alertmanager packages (`make test` installs them
where it can): skipped where missing, failing in CI."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import CI
from tests.helpers import unshared_port, wait_for

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHIPPED = DEPLOY / "alertmanager" / "alertmanager.yml"

RULES = """
groups:
  - name: fired-now
    rules:
      - alert: RollstreamRunDown
        expr: vector(1)
        labels: {severity: page, run: r2}
      - alert: RollstreamTrainerStalled
        expr: max(test_trainers_stalled) > 0
        labels: {severity: page, run: r2}
      - alert: RollstreamTrainerStalled
        expr: max(test_trainers_stalled) > 0
        labels: {severity: page, run: r1}
      - alert: RollstreamDeadLettersRising
        expr: vector(1)
        labels: {severity: ticket, run: r1}
"""


def binary(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        if CI:
            raise RuntimeError(f"no {name}: CI installs Debian's {package} package (make test does)")
        pytest.skip(f"no {name} (apt-get install {package})")
    return found


class Receiver:
    """Webhook receivers on one port: what Alertmanager posts, by path (/page, /ticket);
    and on /metrics the gauge that stalls the trainers (``stalled``)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, Any]]] = []
        self.stalled = threading.Event()
        received, stalled = self.got, self.stalled

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = f"test_trainers_stalled {int(stalled.is_set())}\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, path: str) -> set[tuple[str, str]]:
        """(alertname, run) of the firing alerts posted to ``path``."""
        return {
            (a["labels"]["alertname"], a["labels"].get("run", ""))
            for p, message in list(self.got)
            if p == path
            for a in message["alerts"]
            if a["status"] == "firing"
        }


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def held(am_url: str, *, inhibited: bool = False) -> set[tuple[str, str]]:
    """(alertname, run) of the alerts the Alertmanager holds (``inhibited``: of those held
    back by another)."""
    try:
        alerts = get(f"{am_url}/api/v2/alerts")
    except OSError:
        return set()
    return {
        (a["labels"]["alertname"], a["labels"].get("run", ""))
        for a in alerts
        if a["status"]["inhibitedBy"] or not inhibited
    }


@pytest.mark.timeout(120)
def test_prometheus_alerts_reach_their_receivers_through_the_shipped_alertmanager_config(
    tmp_path: Path, receiver: Receiver, started: list[subprocess.Popen[bytes]]
) -> None:
    prometheus = binary("prometheus", "prometheus")
    alertmanager = binary("prometheus-alertmanager", "prometheus-alertmanager")
    am_port, prom_port = unshared_port(), unshared_port()
    # the shipped routing and inhibition; receivers here, no 30 s wait before a first notice
    config = yaml.safe_load(SHIPPED.read_text())
    for entry in config["receivers"]:
        for hook in entry.get("webhook_configs", []):
            hook["url"] = hook["url"].replace("127.0.0.1:9095", f"127.0.0.1:{receiver.port}")
    config["route"]["group_wait"] = "1s"
    config["route"]["group_interval"] = "1s"
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "rules.yml").write_text(RULES)
    gauge = f"127.0.0.1:{receiver.port}"  # the stalled trainers' gauge
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": "test", "static_configs": [{"targets": [gauge]}]}],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        })
    )  # fmt: skip
    with (tmp_path / "alertmanager.log").open("wb") as log:
        started.append(subprocess.Popen(
            [alertmanager, f"--config.file={tmp_path / 'alertmanager.yml'}",
             f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
             "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    with (tmp_path / "prometheus.log").open("wb") as log:
        started.append(subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
             # resent every second, not every minute: its first sends come before it has
             # discovered the Alertmanager (some 5 s after its start)
             "--rules.alert.resend-delay=1s"],
            stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip

    def logs() -> str:
        return "\n".join((tmp_path / f).read_text()[-2000:] for f in ("alertmanager.log", "prometheus.log"))

    # Then each alert reaches the receiver of its severity
    am_url = f"http://127.0.0.1:{am_port}"
    pages = {("RollstreamRunDown", "r2"), ("RollstreamTrainerStalled", "r1")}
    try:
        # the trainers stall once the Alertmanager holds r2's Redis down
        wait_for(lambda: ("RollstreamRunDown", "r2") in held(am_url), timeout=60)
        receiver.stalled.set()
        wait_for(
            lambda: (
                receiver.alerts("/page") >= pages
                and receiver.alerts("/ticket") >= {("RollstreamDeadLettersRising", "r1")}
            ),
            timeout=60,
        )
        # and r2's stalled trainer is held back by r2's Redis being down (r1's is not)
        wait_for(lambda: ("RollstreamTrainerStalled", "r2") in held(am_url, inhibited=True), timeout=30)
    except AssertionError:
        raise AssertionError(f"received: {receiver.got}\n{logs()}") from None
    assert ("RollstreamTrainerStalled", "r1") not in held(am_url, inhibited=True)
    assert ("RollstreamTrainerStalled", "r2") not in receiver.alerts("/page")
    assert receiver.alerts("/ticket") == {("RollstreamDeadLettersRising", "r1")}
