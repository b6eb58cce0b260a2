"""deploy/k8s's pods on emulated hosts (chaos/hosts.py): each pod a host of its own (its
own address, network, PID, mount and UTS namespaces), running the command line, the
environment, the user and the volumes that the manifests give it (chaos/k8s_manifests.py
reads them), so that a run goes through the manifests as a cluster would run them.

    layout = k8s_manifests.load(manifest_paths(), replicas={"rollstream-ray/gpu": 1})
    with PodRun(layout, out).start() as pods:
        pods.wait_exit(["rollstream-trainer"], 600)
        pods.exec("rollstream-metrics-0", ["rollstream", "status", "--json"])

What each part of a node becomes here:

- the image: this checkout's virtual environment (its ``bin`` first on PATH, as the
  image's ``/opt/venv/bin``), its HOME ``/home/rollstream`` a directory of the pod's own,
  owned by uid 1000 as the image's is; Python's installation made reachable to the pod's
  user when it lies under a directory that user may not enter (``/root``): a tmpfs over
  that directory in the pod's mount namespace with only the installation in it;
- the container's file system: the machine's, with a /tmp and a /dev/shm (64 MiB) of the
  pod's own unless a volume is mounted there. ``readOnlyRootFilesystem`` is approximated
  by the pod's user (not root) on a file system that root owns, with its /tmp and HOME
  read-only; world-writable folders elsewhere (/var/tmp) stay writable;
- DNS: an /etc/hosts of the pod's own (bind-mounted in its mount namespace) naming each
  Service (``svc``, ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.cluster.local``) at its
  first pod's address, each StatefulSet pod by ``pod.svc...``, and the pod itself;
- volumes: an emptyDir a fresh folder (mode 0777; ``medium: Memory`` a tmpfs of its
  sizeLimit), a claim one folder per claim shared by every pod that mounts it (root's,
  0755, as a fresh volume; with the pod's ``fsGroup`` the kubelet's ownership: group
  fsGroup, group-writable, setgid folders), a ConfigMap or Secret its keys as files;
  ``readOnly`` a read-only bind mount;
- the user: ``setpriv`` with the pod's runAsUser, runAsGroup and fsGroup (a supplementary
  group, as the kubelet adds it), no capabilities left, ``--no-new-privs`` for
  ``allowPrivilegeEscalation: false``;
- a pod's containers: on the pod's one host (one mount namespace, the union of their
  mounts, which must agree), each with its own command, environment and user;
- a Job's failed pod is made again after the Job controller's backoff, up to its
  ``backoffLimit``, unless its ``podFailurePolicy`` fails the Job (``poll``); a
  Deployment's pod is not restarted here (``launch`` does it where a test wants the
  restart); ``terminate`` is the kubelet's SIGTERM, then SIGKILL after the grace.

The mount points the manifests name that the machine lacks (/data, /state, /weights,
...) are made as empty folders and removed at the end unless another PodRun is live.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO

from chaos.hosts import LOCK_DIR, Hosts
from chaos.k8s_env import resolve
from chaos.k8s_manifests import CLUSTER_DOMAIN, IMAGE_WORKDIR, NAMESPACE, Layout, Pod

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = (
    "config.yaml",
    "redis-acl.yaml",
    "redis.yaml",
    "ray-cluster.yaml",
    "processes.yaml",
    "trainer-job.yaml",
)
IMAGE_BIN = Path(sys.executable).parent  # the image's /opt/venv/bin
IMAGE_USER = 1000  # deploy/Dockerfile's USER
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MOUNTPOINTS_LOCK = LOCK_DIR / "k8s-mountpoints.lock"
# what deploy/Dockerfile links from its venv onto /usr/local/bin (a login shell's PATH)
IMAGE_LINKS = re.compile(r"ln -s /opt/venv/bin/([\w.-]+) /usr/local/bin/")


def manifest_paths() -> list[Path]:
    return [K8S / name for name in MANIFESTS]


def host_names(pods: list[Pod]) -> dict[str, str]:
    """A host name for each pod (1-10 of [a-z0-9], as the harness wants): its name without
    ``rollstream-``, shortened, its ordinal kept; every container of a pod on its pod's."""
    names: dict[str, str] = {}
    for pod in pods:
        if pod.name != pod.pod_name:
            continue
        plain = "".join(c for c in pod.name.removeprefix("rollstream-") if c.isalnum()).lower()
        digits = len(plain) - len(plain.rstrip("0123456789"))
        base, ordinal = plain[: len(plain) - digits], plain[len(plain) - digits :]
        name = base[: 10 - len(ordinal)] + ordinal
        n = 0
        while name in names.values():
            n += 1
            name = base[: 9 - len(ordinal)] + ordinal + str(n)
        names[pod.name] = name
    return {p.name: names[p.pod_name] for p in pods}


class PodRun:
    """The pods of ``layout`` on emulated hosts; their logs in ``out/<pod>.log``."""

    def __init__(self, layout: Layout, out: Path) -> None:
        self.layout, self.out = layout, out
        self.hostname = host_names(layout.pods)
        self.hosts = Hosts(list(dict.fromkeys(self.hostname.values())))
        self.work = Path(tempfile.mkdtemp(prefix="rollstream-k8s-", dir="/var/tmp"))
        os.chmod(self.work, 0o755)  # the pods' users reach their folders under it
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exits: dict[str, int] = {}  # a pod's exit; a Job's once it is over
        self.failures: dict[str, list[int]] = {}  # a Job's failed pods, made again
        self._again: dict[str, float] = {}  # a Job's pod to make again, when
        self._user: dict[str, tuple[int, int]] = {}
        self._mounted: dict[str, dict[str, str]] = {}  # host -> mount path -> volume
        self._lock: IO[bytes] | None = None

    def claim(self, name: str) -> Path:
        """A claim's folder (made as a fresh volume is: root's, 0755): to put files in first."""
        path = self.work / "claims" / name
        if not path.exists():
            path.mkdir(parents=True)
            os.chmod(path, 0o755)
        return path

    # --- start -----------------------------------------------------------------------

    def start(self) -> PodRun:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self.hosts.start()
            resolve(
                self.layout, {p.name: self.hosts.address(self.hostname[p.name]) for p in self.layout.pods}
            )
            self._mountpoints()
            for pod in self.layout.pods:
                self._prepare(pod)
            for pod in self.layout.pods:
                self.launch(pod)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> PodRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mountpoints(self) -> None:
        """The folders the pods mount on that the machine lacks, made empty, and noted in
        the lock file (shared while a run lives): the last run to end removes them."""
        MOUNTPOINTS_LOCK.parent.mkdir(parents=True, exist_ok=True)
        self._lock = MOUNTPOINTS_LOCK.open("a+b")
        fcntl.flock(self._lock, fcntl.LOCK_SH)  # held while this run lives
        wanted = {m.path for p in self.layout.pods for m in p.mounts} | {IMAGE_WORKDIR}
        for path in sorted(map(Path, wanted)):
            missing = [p for p in (path, *path.parents) if not p.exists()]
            for folder in reversed(missing):
                folder.mkdir()
                self._lock.write(f"{folder}\n".encode())
                self._lock.flush()

    def hosts_file(self, pod: Pod) -> str:
        lines = ["127.0.0.1\tlocalhost", f"{pod.address}\t{pod.pod_name} {self.hostname[pod.name]}"]
        for svc in self.layout.services:
            backing = self.layout.backing(svc)
            if not backing:
                continue
            names = [svc.name, f"{svc.name}.{NAMESPACE}", f"{svc.name}.{NAMESPACE}.svc",
                     f"{svc.name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"]  # fmt: skip
            lines.append(f"{backing[0].address}\t{' '.join(names)}")
            for member in backing:
                if member.kind == "StatefulSet":
                    fq = f"{member.name}.{svc.name}.{NAMESPACE}.svc"
                    lines.append(f"{member.address}\t{fq} {fq}.{CLUSTER_DOMAIN}")
        return "\n".join(lines) + "\n"

    def _prepare(self, pod: Pod) -> None:
        """The pod's folders, and its mounts made in its host's mount namespace (its
        other containers' too: they share the host, so a path is mounted once, with one
        volume)."""
        host = self.hostname[pod.name]
        base = self.work / "pods" / pod.pod_name
        uid = pod.uid if pod.uid is not None else IMAGE_USER
        gid = pod.gid if pod.gid is not None else uid
        self._user[pod.name] = (uid, gid)
        # rollstream's image: its venv first; Redis's: the machine's redis-server (7.x, not
        # the 6.2 copy that a venv may hold)
        rollstream = pod.image.startswith("rollstream:")
        pod.env["PATH"] = f"{IMAGE_BIN}{os.pathsep}{SYSTEM_PATH}" if rollstream else SYSTEM_PATH
        pod.env.setdefault("HOME", IMAGE_WORKDIR)
        script: list[str] = ["set -e"]
        kept: list[str] = []
        if host not in self._mounted:
            layer, kept = self._container_layer(pod, base)
            script += layer
        mounted = self._mounted.setdefault(host, {})
        for m in pod.mounts:
            if m.path in mounted:
                if mounted[m.path] != m.volume:
                    raise RuntimeError(
                        f"{pod.name}: {m.path} is volume {mounted[m.path]} in another container"
                    )
                continue
            mounted[m.path] = m.volume
            vol = pod.volumes[m.volume]
            if vol.kind == "emptyDir" and vol.medium == "Memory":
                size = f",size={vol.size.removesuffix('i').lower()}" if vol.size else ""
                script.append(f"mount -t tmpfs -o mode=0777{size} tmpfs {shlex.quote(m.path)}")
                continue
            if vol.kind == "emptyDir":
                src = base / f"vol-{vol.name}"
                if not src.exists():
                    src.mkdir()
                    os.chmod(src, 0o777)
            elif vol.kind == "claim":
                src = self.claim(vol.source)
            else:  # configMap, secret: its keys as files, read-only
                src = base / f"{vol.kind}-{vol.name}"
                src.mkdir(exist_ok=True)
                for key, value in vol.items.items():
                    (src / key).write_text(value)
                    os.chmod(src / key, 0o644)
                    if pod.fs_group is not None:
                        os.chown(src / key, 0, pod.fs_group)
            if pod.fs_group is not None and vol.kind in ("emptyDir", "claim"):
                _own_by_group(src, pod.fs_group)
            script += _bind(src, m.path, m.read_only or vol.kind in ("configMap", "secret"))
        script += kept  # the checkout back where a /tmp of the pod's own went over it
        done = self.hosts.run(host, ["sh", "-c", "\n".join(script)], timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{pod.name}: its mounts failed: {done.stderr.strip()}")

    def _container_layer(self, pod: Pod, base: Path) -> tuple[list[str], list[str]]:
        """What the container runtime gives a pod: its /tmp, /dev/shm, HOME, /etc/hosts
        and the image's Python and /usr/local/bin; as mount commands, and those to run
        after the pod's volumes are mounted (the checkout back under a /tmp of its own)."""
        base.mkdir(parents=True)
        os.chmod(base, 0o755)
        (base / "hosts").write_text(self.hosts_file(pod))
        os.chmod(base / "hosts", 0o644)
        home = base / "home"
        home.mkdir()
        os.chown(home, IMAGE_USER, IMAGE_USER)  # the image's HOME, its user's
        (base / "tmp").mkdir(mode=0o1777)
        os.chmod(base / "tmp", 0o1777)
        before, after = _kept_under_tmp(base)
        script = ["mount --make-rprivate /", *before, *self._expose_python(base), *self._image_links(base)]
        mounted = {m.path for p in self.layout.pods if p.pod_name == pod.pod_name for m in p.mounts}
        if "/tmp" not in mounted:  # the container's own /tmp
            script += _bind(base / "tmp", "/tmp", pod.read_only_root)
        if "/dev/shm" not in mounted:  # a container's default /dev/shm
            script.append("mount -t tmpfs -o size=64m,mode=1777 shm /dev/shm")
        script += _bind(home, IMAGE_WORKDIR, pod.read_only_root)
        script += _bind(base / "hosts", "/etc/hosts", True)
        return script, after

    @staticmethod
    def _expose_python(base: Path) -> list[str]:
        """Python's installation reachable by any user: the first folder above it that
        others may not enter (``/root``) replaced, in the pod, by a tmpfs holding only it."""
        real = Path(os.path.realpath(sys.base_prefix))
        for parent in reversed(real.parents):
            if parent != Path("/") and not parent.stat().st_mode & stat.S_IXOTH:
                child = real.relative_to(parent).parts[0]
                stage = base / "python"
                stage.mkdir()
                q = shlex.quote
                return [f"mount --bind {q(str(parent / child))} {q(str(stage))}",
                        f"mount -t tmpfs -o mode=0755,size=1m image {q(str(parent))}",
                        f"mkdir {q(str(parent / child))}",
                        f"mount --move {q(str(stage))} {q(str(parent / child))}"]  # fmt: skip
        return []

    @staticmethod
    def _image_links(base: Path) -> list[str]:
        """The image's /usr/local/bin: the machine's, and what deploy/Dockerfile links there
        from its venv (the venv here)."""
        folder = base / "usr-local-bin"
        folder.mkdir()
        for entry in Path("/usr/local/bin").iterdir():
            (folder / entry.name).symlink_to(entry)
        for name in IMAGE_LINKS.findall((ROOT / "deploy" / "Dockerfile").read_text()):
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
            (folder / name).symlink_to(IMAGE_BIN / name)
        return _bind(folder, "/usr/local/bin", True)

    def user_argv(self, pod: Pod, argv: list[str]) -> list[str]:
        """``argv`` as the pod's user: its uid, gid, fsGroup, no capabilities."""
        uid, gid = self._user[pod.name]
        groups = ["--groups", str(pod.fs_group)] if pod.fs_group is not None else ["--clear-groups"]
        nnp = ["--no-new-privs"] if pod.no_new_privs else []
        return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *groups, *nnp,
                "--inh-caps=-all", "--bounding-set=-all", "--", *argv]  # fmt: skip

    def launch(self, pod: Pod) -> subprocess.Popen[bytes]:
        with (self.out / f"{pod.name}.log").open("ab") as log:
            proc = self.hosts.popen(self.hostname[pod.name], self.user_argv(pod, pod.command), env=pod.env,
                                    cwd=IMAGE_WORKDIR, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)  # fmt: skip
        self.procs[pod.name] = proc
        self.exits.pop(pod.name, None)
        return proc

    # --- while it runs ---------------------------------------------------------------

    def exec(self, pod_name: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``kubectl exec``: ``argv`` in the pod, as its user, with its environment."""
        pod = self.layout.pod(pod_name)
        return self.hosts.run(self.hostname[pod_name], self.user_argv(pod, argv), timeout=timeout,
                              env=pod.env, cwd=IMAGE_WORKDIR)  # fmt: skip

    def ready(self, pod_name: str) -> bool:
        """The pod's exec readiness probe passes (True when it has none)."""
        probe = self.layout.pod(pod_name).readiness
        return probe is None or self.exec(pod_name, probe).returncode == 0

    def alive(self, pod_name: str, timeout: float = 10) -> bool:
        """The pod's liveness probe (exec, httpGet or tcpSocket, its port by name) passes."""
        pod = self.layout.pod(pod_name)
        probe = pod.liveness
        if "exec" in probe:
            return self.exec(pod_name, probe["exec"]["command"], timeout=60).returncode == 0
        kind = "httpGet" if "httpGet" in probe else "tcpSocket"
        port = probe[kind]["port"]
        port = pod.ports[port] if isinstance(port, str) else int(port)
        try:
            if kind == "httpGet":
                url = f"http://{pod.address}:{port}{probe['httpGet'].get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout) as answer:
                    status: int = answer.status
                return 200 <= status < 400
            socket.create_connection((pod.address, port), timeout=timeout).close()
            return True
        except OSError:
            return False

    def poll(self) -> dict[str, int]:
        """Every pod that has exited: its exit status. A Job's failed pod is made again
        (on the same host, its volumes as they are) after the Job controller's backoff,
        10 s doubling, up to its backoffLimit, unless its podFailurePolicy fails the Job."""
        now = time.monotonic()
        for name, proc in list(self.procs.items()):
            if name in self.exits or name in self._again or proc.poll() is None:
                if name in self._again and now >= self._again[name]:
                    del self._again[name]
                    self.launch(self.layout.pod(name))
                continue
            pod, code = self.layout.pod(name), proc.returncode
            failed = self.failures.setdefault(name, []) if pod.is_job else []
            if pod.is_job and code != 0 and code not in pod.fail_codes and len(failed) < pod.backoff_limit:
                failed.append(code)
                self._again[name] = now + min(10.0 * 2 ** (len(failed) - 1), 360.0)
            else:
                self.exits[name] = code
        return dict(self.exits)

    def wait_exit(self, pod_names: list[str], timeout: float) -> dict[str, int]:
        """Until each of ``pod_names`` has exited (or the time is up): their exits so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exits = self.poll()
            if all(n in exits for n in pod_names):
                break
            time.sleep(0.5)
        return {n: self.exits[n] for n in pod_names if n in self.exits}

    def terminate(self, pod_name: str, grace: float = 60) -> int:
        """The kubelet's stop: SIGTERM to the container's first process, SIGKILL after
        ``grace`` seconds; its exit status (negative: the signal that ended it)."""
        proc = self.procs[pod_name]
        if proc.poll() is None:
            for pid in _children(proc.pid):  # nsenter's child: the container's process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.hosts.crash(self.hostname[pod_name])
                proc.wait(timeout=60)
        self.poll()
        return self.exits[pod_name]

    def log(self, pod_name: str, tail: int = 3000) -> str:
        path = self.out / f"{pod_name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    # --- the end ---------------------------------------------------------------------

    def close(self) -> None:
        """Every host (and so every pod) gone, the work folder and the mount points made."""
        self.hosts.close()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        shutil.rmtree(self.work, ignore_errors=True)
        if self._lock is not None:
            try:  # the last live run removes the mount points
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock.seek(0)
                for line in reversed(self._lock.read().decode().splitlines()):
                    with contextlib.suppress(OSError):
                        Path(line).rmdir()  # only if still empty
                self._lock.truncate(0)
            except BlockingIOError:
                pass
            self._lock.close()
            self._lock = None


def _bind(src: Path, dst: str, read_only: bool) -> list[str]:
    q = shlex.quote
    lines = [f"mount --bind {q(str(src))} {q(dst)}"]
    if read_only:
        lines.append(f"mount -o remount,bind,ro {q(dst)}")
    return lines


def _own_by_group(path: Path, gid: int) -> None:
    """The kubelet's fsGroup on a volume: every file of group ``gid``, group-writable,
    folders setgid (so what is made in them stays of the group)."""
    for folder, dirs, files in os.walk(path):
        for name in [None, *dirs, *files]:
            item = Path(folder) / name if name else Path(folder)
            os.chown(item, -1, gid)
            mode = item.stat().st_mode
            extra = stat.S_IRGRP | stat.S_IWGRP | (stat.S_IXGRP | stat.S_ISGID if item.is_dir() else 0)
            os.chmod(item, stat.S_IMODE(mode) | extra)


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def trainer_command(layout: Layout, steps: int, drop: tuple[str, ...] = ("--hf-model",)) -> list[str]:
    """The trainer Job's own command line with ``--steps`` set and the options in
    ``drop`` (with their values) taken out."""
    argv = list(layout.pod("rollstream-trainer").command)
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in drop:
            skip = True
            continue
        out.append(str(steps) if i > 0 and argv[i - 1] == "--steps" else arg)
    return out


def _kept_under_tmp(base: Path) -> tuple[list[str], list[str]]:
    """A checkout (and its venv, the image's stand-in) that lies under the machine's /tmp
    (a CI clone) stays where it is in a pod whose /tmp is its own: bound aside before the
    pod's /tmp goes over it, moved back in after (mount commands: before, after)."""
    q = shlex.quote
    before: list[str] = []
    after: list[str] = []
    kept: list[Path] = []
    for path in sorted({ROOT.resolve(), Path(sys.prefix).resolve()}):
        if not path.is_relative_to("/tmp") or any(path.is_relative_to(k) for k in kept):
            continue
        kept.append(path)
        stage = base / f"kept-{len(kept)}"
        stage.mkdir()
        # its mount point made in the pod's /tmp beforehand (a read-only one takes no mkdir)
        (base / "tmp" / path.relative_to("/tmp")).mkdir(mode=0o755, parents=True)
        before.append(f"mount --bind {q(str(path))} {q(str(stage))}")
        # (a volume at /tmp, an emptyDir, is writable: the mount point is made there)
        after.append(f"mkdir -p {q(str(path))} 2>/dev/null || true")
        after.append(f"mount --move {q(str(stage))} {q(str(path))}")
    return before, after
