from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from rollstream.producer.feeder import Cursor, Feeder
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.errors import FeederError, InputError, PromptFileError
from tests.conftest import BufferFactory


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"uid": f"r{i}", "prompt": f"p{i}"}) + b"\n" for i in range(10)))
    return path


def drain(buffer: ReplayBuffer) -> list[str]:
    """A producer that claims everything fed so far and finishes it."""
    out = []
    while claims := buffer.claim("math", 100):
        for claim in claims:
            buffer.drop(claim)
            out.append(claim.prompt.uid)
    return out


def test_keeps_about_k_unclaimed_and_feeds_every_row_once_per_epoch(
    fake_buffer: BufferFactory, dataset: Path
) -> None:
    buffer = fake_buffer("feeder")
    feeder = Feeder(buffer, dataset, "math", epochs=3, shuffle=True, seed=7, keep_ahead=4)
    raw, cursor = feeder.start_cursor()
    seen: list[str] = []
    while cursor.epoch < 3:
        raw, cursor, fed = feeder.step(raw, cursor)
        assert buffer.unclaimed("math") <= 4
        assert fed > 0
        seen += drain(buffer)
    counts = Counter(uid.split("@")[0] for uid in seen)
    assert counts == {f"r{i}": 3 for i in range(10)}
    by_epoch = [[u for u in seen if u.endswith(f"@{e}")] for e in range(3)]
    assert [len(e) for e in by_epoch] == [10, 10, 10]
    assert by_epoch[0] != by_epoch[1]  # shuffled per epoch
    # the same seed gives every feeder the same order
    again = Feeder(fake_buffer("other"), dataset, "math", shuffle=True, seed=7)
    assert [f"r{i}@0" for i in again.order(0)] == by_epoch[0]


def test_restarted_feeder_goes_on_where_it_stopped(fake_buffer: BufferFactory, dataset: Path) -> None:
    first = Feeder(fake_buffer("f1"), dataset, "math", epochs=2, shuffle=True, seed=1, keep_ahead=6)
    raw, cursor = first.start_cursor()
    raw, cursor, _ = first.step(raw, cursor)  # 6 fed, then the process dies
    consumer = fake_buffer("producer")
    seen = drain(consumer)
    second = Feeder(fake_buffer("f2"), dataset, "math", epochs=2, shuffle=True, seed=1, keep_ahead=6)
    assert second.start_cursor()[1] == Cursor(second.source, 1, True, epoch=0, pos=6)
    raw, cursor = second.start_cursor()
    while cursor.epoch < 2:
        raw, cursor, _ = second.step(raw, cursor)
        seen += drain(consumer)
    assert sorted(seen) == sorted(f"r{i}@{e}" for i in range(10) for e in range(2))
    assert second.run().fed == 0  # everything is fed: a third start has nothing to do


def test_two_feeders_cannot_both_advance_the_cursor(fake_buffer: BufferFactory, dataset: Path) -> None:
    a = Feeder(fake_buffer("a"), dataset, "math", keep_ahead=3)
    b = Feeder(fake_buffer("b"), dataset, "math", keep_ahead=3)
    raw_a, cur_a = a.start_cursor()
    raw_b, cur_b = b.start_cursor()
    a.step(raw_a, cur_a)
    drain(fake_buffer("producer"))
    with pytest.raises(FeederError, match="another feeder"):
        b.step(raw_b, cur_b)
    assert a.buffer.client.hget(a.buffer.keys.progress, "math:fed") == b"3"


def test_a_different_dataset_or_seed_is_refused(
    fake_buffer: BufferFactory, dataset: Path, tmp_path: Path
) -> None:
    first = Feeder(fake_buffer("a"), dataset, "math", shuffle=True, seed=1, keep_ahead=2)
    first.step(*first.start_cursor())
    with pytest.raises(FeederError, match="seed 1"):
        Feeder(fake_buffer("b"), dataset, "math", shuffle=True, seed=2).start_cursor()
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "x"}\n')
    with pytest.raises(FeederError, match="another run name"):
        Feeder(fake_buffer("c"), other, "math", shuffle=True, seed=1).start_cursor()


def test_bad_line_stops_the_feeder_before_anything_is_written(
    fake_buffer: BufferFactory, tmp_path: Path
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"promt": "c"}\n')
    buffer = fake_buffer("f")
    with pytest.raises(PromptFileError, match=r"bad.jsonl:3: needs exactly one"):
        Feeder(buffer, path, "math")
    assert buffer.client.exists(buffer.keys.prompts("math")) == 0
    with pytest.raises(InputError, match="--epochs"):
        Feeder(buffer, path, "math", epochs=0)


@pytest.mark.parametrize("change", ["rewritten", "deleted"])
def test_a_file_changed_under_the_feeder_is_an_input_error(
    fake_buffer: BufferFactory, dataset: Path, change: str
) -> None:
    feeder = Feeder(fake_buffer("feeder"), dataset, "math", epochs=2, keep_ahead=4)
    raw, cursor = feeder.start_cursor()
    raw, cursor, _ = feeder.step(raw, cursor)
    if change == "deleted":
        dataset.unlink()
    else:
        dataset.write_bytes(dataset.read_bytes() + b'{"uid": "new", "prompt": "p"}\n')
    drain(fake_buffer("producer"))
    # exit 2, as every other problem of an input file (was FeederError: exit 1)
    with pytest.raises(InputError, match=str(dataset)) as info:
        feeder.step(raw, cursor)
    assert not isinstance(info.value, FeederError)
