"""The shm weight transport's parts: the slot layout, the fence (a half-written slot is
never read: a writer stopped between the fence's two writes, a trainer process killed
mid-copy), only what changed moving, the files' clean-up, and the ``auto`` choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.helpers import require

torch = require("torch", "hf")

from rollstream.shared.shm_slot import DATA_AT, HEADER, plan, read_header
from rollstream.shared.transport_auto import AutoSender, Placement, choose, ipc_capability
from rollstream.shared.transport_shm import ShmSender, parse, receive_shm, sweep
from rollstream.shared.transports import TransportSettings, WeightError, receive


def tensors() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "a": torch.randn(33, 7),
        "b": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(3, 3).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }


@pytest.fixture
def sender(tmp_path: Path) -> Any:
    s = ShmSender(TransportSettings(kind="shm", changed_only=True), run="unit", root=tmp_path / "shm")
    yield s
    s.close()


def test_the_layout_aligns_every_tensor_after_the_header() -> None:
    specs = [("a", "float32", (3,), 12), ("b", "int64", (0,), 0), ("c", "uint8", (65,), 65)]
    offsets, end = plan(specs)
    assert offsets == {"a": (DATA_AT, 12), "b": (DATA_AT + 64, 0), "c": (DATA_AT + 64, 65)}
    assert end == DATA_AT + 64 + 128 and all(o % 64 == 0 for o, _ in offsets.values())


def test_every_sync_reads_back_exactly_what_was_sent(sender: ShmSender) -> None:
    sent = tensors()
    uri = sender.send(1, sent)
    path, step, seq, token, node, fallback = parse(uri)
    assert (step, seq, token, fallback) == (1, 2, sender.token, "") and node
    got = dict(receive(uri, {}))
    assert got.keys() == sent.keys()
    for name, t in sent.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # the slot's own header says the same, and the index is orjson, not pickle
    raw = path.read_bytes()
    magic, fence, at_step, offset, length, _, _ = HEADER.unpack_from(raw, 0)
    assert (magic, fence, at_step) == (b"RSWSHM01", 2, 1)
    assert raw[offset : offset + length].startswith(b'{"format":1')


def test_two_slots_take_turns_and_a_slot_reused_fails_its_old_uri(sender: ShmSender) -> None:
    sent = tensors()
    first = sender.send(1, sent)
    second = sender.send(2, sent)
    assert parse(first)[0] != parse(second)[0]  # step 2 went to the other slot
    assert len(dict(receive(first, {}))) == len(sent)  # still readable while step 2 is out
    third = sender.send(3, sent)
    assert parse(third)[0] == parse(first)[0]
    with pytest.raises(WeightError, match="holds a later step"):
        dict(receive(first, {}))
    assert len(dict(receive(second, {}))) == len(sent)


def test_only_what_changed_is_written_and_read(sender: ShmSender) -> None:
    sent = tensors()
    sources: dict[str, str] = {}
    dict(receive(sender.send(1, sent), sources))
    sent["a"].add_(1.0)  # an optimizer step changes "a" only
    uri = sender.send(2, sent)
    assert sender.last["written"] == len(sent)  # the other slot's first write: all of it
    assert list(dict(receive(uri, sources))) == ["a"]
    uri = sender.send(3, sent)  # back to the first slot: only "a" changed since it was written
    assert sender.last["written"] == 1
    assert list(dict(receive(uri, sources))) == []  # nothing changed since step 2
    sent["b"].add_(1)
    uri = sender.send(4, sent)
    assert sender.last["written"] == 1  # "b": this slot has held step 2's "a" since step 2
    got = dict(receive(uri, sources))
    assert list(got) == ["b"] and torch.equal(got["b"], sent["b"])
    # an engine that starts now reads the whole set, each tensor's latest value
    fresh = dict(receive(uri, {}))
    assert all(torch.equal(fresh[n], t) for n, t in sent.items())


def test_a_new_set_of_tensors_gets_a_larger_file(sender: ShmSender) -> None:
    sent = tensors()
    sender.send(1, sent)
    sender.send(2, sent)
    old = parse(sender.send(3, sent))[0]
    bigger = {**sent, "a": torch.randn(300, 70), "new": torch.ones(1000)}
    uri = sender.send(4, bigger)
    path = parse(uri)[0]
    assert old.name == "slot-1-1" and path.name == "slot-0-2"  # a new generation of slot 0
    assert not (path.parent / "slot-0-1").exists() and old.exists()  # the old one is gone
    got = dict(receive(uri, {}))
    assert got.keys() == bigger.keys() and all(torch.equal(got[n], t) for n, t in bigger.items())


def test_a_writer_stopped_between_the_fences_two_writes_is_never_read(sender: ShmSender) -> None:
    sent = tensors()
    first = sender.send(1, sent)
    sender.send(2, sent)
    slot = sender.slots[parse(first)[0] == sender.slots[1].path]
    slot.begin()  # the trainer starts step 3 in step 1's slot, then stops
    assert read_header(slot.map)[0] % 2 == 1
    with pytest.raises(WeightError, match="being written"):
        dict(receive(first, {}))


def test_a_writer_that_starts_while_a_reader_copies_fails_that_read(
    sender: ShmSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orjson

    from rollstream.shared import transport_shm

    uri = sender.send(1, tensors())
    slot = sender.slots[sender.last["slot"]]

    class Racing:  # the trainer begins a write into this slot once the reader has checked
        @staticmethod
        def loads(raw: bytes) -> Any:
            slot.begin()
            return orjson.loads(raw)

    monkeypatch.setattr(transport_shm, "orjson", Racing)
    sources: dict[str, str] = {}
    with pytest.raises(WeightError, match="being written after reading"):
        dict(receive_shm(uri, sources))
    assert sources == {}  # nothing recorded as loaded


def test_bad_uris_and_foreign_files_get_clear_errors(sender: ShmSender, tmp_path: Path) -> None:
    with pytest.raises(WeightError, match="not shm://"):
        parse("shm:///dev/shm/x?step=1")
    with pytest.raises(WeightError, match="seq=<even>"):
        parse(f"shm:///dev/shm/x?step=1&seq=3&token={'0' * 32}")
    uri = sender.send(1, tensors())
    query = parse_qs(urlsplit(uri).query)
    gone = uri.replace(query["token"][0], "1" * 32)  # another sender's file at that path
    with pytest.raises(WeightError, match="no such shared-memory file here"):
        dict(receive(gone, {}))
    missing = f"shm://{tmp_path}/none?step=1&seq=2&token={'0' * 32}&node=elsewhere"
    with pytest.raises(WeightError, match="trainer is on node 'elsewhere'"):
        dict(receive(missing, {}))
    with pytest.raises(WeightError, match="not a weights slot"):
        read_header(b"x" * 64)


def test_a_uri_from_another_node_reads_its_fallback(sender: ShmSender, tmp_path: Path) -> None:
    from rollstream.shared.transports import sender_for

    files = sender_for(TransportSettings(), str(tmp_path / "files"))
    sent = tensors()
    fallback = files.send(1, sent)
    uri = sender.send(1, sent, fallback=fallback)
    elsewhere = uri.replace(str(parse(uri)[0]), str(tmp_path / "not-here"))
    got = dict(receive(elsewhere, {}))
    assert all(torch.equal(got[n], t) for n, t in sent.items())
    files.close()


def test_close_removes_the_files_and_a_dead_trainers_are_swept(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    s = ShmSender(TransportSettings(kind="shm"), run="sweep", root=root)
    s.send(1, tensors())
    assert list(s.directory.iterdir())
    s.close()
    assert not s.directory.exists()
    # a trainer process that is gone (here: one that has exited) leaves its directory
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = root / f"sweep-{int(child.stdout)}-abcd"
    dead.mkdir()
    alive = root / f"sweep-{os.getpid()}-abcd"
    alive.mkdir()
    other_run = root / f"other-{int(child.stdout)}-abcd"
    other_run.mkdir()
    assert sweep(root, "sweep") == [dead]
    assert alive.exists() and other_run.exists()


WRITER = """
import sys, torch
from rollstream.shared.transport_shm import ShmSender
from rollstream.shared.transports import TransportSettings
sender = ShmSender(TransportSettings(kind="shm"), run="torn", root=sys.argv[1])
tensors = {f"t{i}": torch.full((256, 256), float(i)) for i in range(8)}
print(sender.send(1, tensors), flush=True)
print(sender.send(2, tensors), flush=True)
copy = sender._copy
def halfway(slot, todo, *args, **kwargs):
    names = list(todo)
    copy(slot, {n: todo[n] for n in names[: len(names) // 2]})
    print("halfway", flush=True)
    sys.stdin.read()  # stopped mid-copy until killed
sender._copy = halfway
for t in tensors.values():
    t.add_(1)
sender.send(3, tensors)
"""


def test_a_trainer_killed_mid_copy_leaves_nothing_that_loads(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    with subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:  # fmt: skip
        try:
            assert child.stdout is not None
            first, second = child.stdout.readline().strip(), child.stdout.readline().strip()
            assert child.stdout.readline().strip() == "halfway"
            child.kill()  # by its handle: SIGKILL, mid-copy of step 3 into step 1's slot
            assert child.wait(timeout=60) == -9
        finally:
            if child.poll() is None:
                child.kill()
    with pytest.raises(WeightError, match="being written"):
        dict(receive(first, {}))
    got = dict(receive(second, {}))  # the other slot is whole: step 2
    assert all(torch.equal(t, torch.full((256, 256), float(n[1:]))) for n, t in got.items())
    # the run's next trainer sweeps what the killed one left
    again = ShmSender(TransportSettings(kind="shm"), run="torn", root=root)
    assert [p.name for p in root.iterdir()] == [again.directory.name]
    again.close()


# --- auto --------------------------------------------------------------------------

HERE = Placement("node-a", "cuda:0")


def test_auto_picks_shm_for_engines_on_the_trainers_node() -> None:
    choice = choose(
        HERE, [Placement("node-a", "cuda:1"), Placement("node-a", "cpu")], TransportSettings(), True
    )
    assert (choice.kind, choice.fallback) == ("shm", "")
    assert "every engine on the trainer's node" in choice.reason


def test_auto_picks_a_remote_transport_for_engines_elsewhere() -> None:
    others = [Placement("node-b", "cuda:0")]
    assert choose(HERE, others, TransportSettings(), True).kind == "collective"
    assert choose(HERE, others, TransportSettings(dir="/shared/w"), True).kind == "file"
    mixed = choose(HERE, [*others, Placement("node-a", "cuda:1")], TransportSettings(), True)
    assert (mixed.kind, mixed.fallback) == ("shm", "collective") and "1 of 2" in mixed.reason


def test_auto_without_tmpfs_or_knowledge_of_the_engines() -> None:
    mine = [Placement("node-a")]
    assert choose(HERE, mine, TransportSettings(), shm=False).kind == "collective"
    unknown = choose(HERE, None, TransportSettings(), True)
    assert (unknown.kind, unknown.fallback) == ("shm", "") and "not known" in unknown.reason
    reachable = choose(HERE, [], TransportSettings(address="10.0.0.1:29500"), True)
    assert (reachable.kind, reachable.fallback) == ("shm", "collective")


def test_ipc_is_chosen_only_for_the_same_gpu_where_cuda_is() -> None:
    same = Placement("node-a", "cuda:0")
    ok, why = ipc_capability(HERE, same, built=False)
    assert not ok and "turned off" in why
    cases = [
        (Placement("node-a", "cpu"), "not both on a GPU"),
        (Placement("node-b", "cuda:0"), "other nodes"),
        (Placement("node-a", "cuda:1"), "other GPUs"),
    ]
    for engine, why in cases:
        ok, reason = ipc_capability(HERE, engine)
        assert not ok and why in reason
        assert choose(HERE, [engine, same], TransportSettings(), True).kind != "ipc"
    ok, reason = ipc_capability(HERE, same)  # then what CUDA here says
    assert ok == torch.cuda.is_available()
    expected = "ipc" if ok else "shm"  # without CUDA: the shared memory, saying why
    assert choose(HERE, [same], TransportSettings(), True).kind == expected
    if not ok:
        assert "CUDA is not available" in reason


def test_an_ipc_sender_without_gpu_tensors_writes_the_shared_memory(tmp_path: Path) -> None:
    sender = ShmSender(TransportSettings(kind="shm"), run="ipc", root=tmp_path / "shm", ipc=True, host=False)
    try:
        sent = tensors()
        uri = sender.send(1, sent)
        assert "not all on a GPU" in sender._ipc_why
        got = dict(receive(uri, {}))
        assert all(torch.equal(got[n], t) for n, t in sent.items())
    finally:
        sender.close()


def test_a_reader_that_cannot_map_the_trainers_gpu_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index that names a device twin: a reader not on that GPU reads the host bytes
    when there are some, and fails naming why when the trainer wrote none."""
    from rollstream.shared import transport_ipc

    assert "shares no GPU buffer" in transport_ipc.reader_capability(None, None)[1]
    assert "not on a GPU" in transport_ipc.reader_capability({"uuid": "GPU-x"}, torch.device("cpu"))[1]
    if not torch.cuda.is_available():
        assert (
            "CUDA is not available"
            in transport_ipc.reader_capability({"uuid": "x"}, torch.device("cuda:0"))[1]
        )
    # a twin faked in host memory: the sender's side of it runs without a GPU
    monkeypatch.setattr(transport_ipc, "sender_capability", lambda t: (torch.device("cpu"), "faked"))

    def fake(self: Any, slot: int, size: int, device: Any) -> tuple[Any, dict[str, Any]]:
        return torch.zeros(size, dtype=torch.uint8), {"uuid": "GPU-x"}

    monkeypatch.setattr(transport_ipc.Twins, "get", fake)
    sent = tensors()
    for host in (True, False):
        sender = ShmSender(
            TransportSettings(kind="shm"), run=f"ipc{host}", root=tmp_path / "s", ipc=True, host=host
        )
        try:
            uri = sender.send(1, sent)
            if host:
                got = dict(receive(uri, {}))
                assert all(torch.equal(got[n], t) for n, t in sent.items())
            else:
                with pytest.raises(WeightError, match=r"only on the trainer's GPU .* not on a GPU"):
                    dict(receive(uri, {}, device=torch.device("cpu")))
        finally:
            sender.close()


def test_the_auto_sender_follows_the_engines(tmp_path: Path) -> None:
    where = [Placement("node-a")]
    settings = TransportSettings(kind="auto", dir=str(tmp_path / "files"))
    sender = AutoSender(settings, str(tmp_path / "out"), "auto", {}, engines=lambda: where,
                        trainer=Placement("node-a"))  # fmt: skip
    sent = tensors()
    try:
        assert urlsplit(sender.send(1, sent)).scheme == "shm"
        where = [Placement("node-a"), Placement("node-b")]
        uri = sender.send(2, sent)
        assert "fallback" in parse_qs(urlsplit(uri).query) and sender.choice is not None
        where = [Placement("node-b")]
        uri = sender.send(3, sent)
        assert Path(uri).parent == tmp_path / "files"
        got = dict(receive(uri, {}))
        assert all(torch.equal(got[n], t) for n, t in sent.items())
    finally:
        sender.close()


def test_a_reader_lets_go_of_files_the_trainer_removed(sender: ShmSender) -> None:
    from rollstream.shared import transport_shm

    uri = sender.send(1, tensors())
    dict(receive(uri, {}))
    path = parse(uri)[0]
    assert path in transport_shm._MAPPED
    sender.close()  # the files go
    with pytest.raises(WeightError, match="no such shared-memory file"):
        dict(receive(uri, {}))
    assert path not in transport_shm._MAPPED  # its memory is not held by this process


def test_a_sender_never_closed_removes_its_files_when_its_process_exits(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "from rollstream.shared.transport_shm import ShmSender\n"
        "from rollstream.shared.transports import TransportSettings\n"
        "s = ShmSender(TransportSettings(kind='shm'), run='exit', root=sys.argv[1])\n"
        "s.send(1, {'a': torch.ones(10)})\n"
        "print(s.directory, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "shm")],
                          capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    directory = Path(done.stdout.strip())
    assert directory.parent == tmp_path / "shm" and not directory.exists()
