"""The rollout archive (consumer/archive.py): the trainer's commit copies each group it
trained to the trained log in its own script, and the archiver writes every trained
group, and every untrained prompt with its reason, to Parquet exactly once."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from rollstream.cli.main import main
from rollstream.shared.connection import connect
from rollstream.shared.embedded import EmbeddedRedis
from rollstream.shared.events import STOP, RunControl
from rollstream.shared.keys import ARCHIVE, TRAINER, Keys
from rollstream.shared.records import MODEL, TOOL, Group, Prompt, Sample, Turn
from rollstream.shared.runconfig import open_buffer
from tests.conftest import BufferFactory, SettingsFactory
from tests.helpers import group_for, prompts, require, rollstream, wait_for

pa = require("pyarrow", "archive")
pq = require("pyarrow.parquet", "archive")

from rollstream.consumer.assembly import create_archiver, run_archiver

pytestmark = pytest.mark.integration


def _archive_settings(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {"archive": {"keep": 1000, "dir": str(tmp_path / "archive"), "flush_s": 0.05, **more}}


@pytest.fixture
def tree(redis_server: EmbeddedRedis, make_settings: SettingsFactory) -> SettingsFactory:
    """tree(**overrides): the settings tree real_buffer opens a buffer of the same overrides
    from, which the archiver takes (a buffer holds only the sections it uses)."""
    return lambda **overrides: make_settings(redis_server.url, **overrides)


def _produce_and_train(
    producer: Any, trainer: Any, task: str, count: int, step: int, *, start: int = 0
) -> list[str]:
    """Feed, complete and commit ``count`` groups at train step ``step``; their group ids."""
    producer.feed(prompts(task, count, start))
    done = []
    for claim in producer.claim(task, count):
        group = group_for(claim.prompt, n=4, tokens=6, step=step - 1)
        group.producer = producer.consumer
        producer.complete(claim, group)
        done.append(claim.group_id)
    batch = trainer.read_batch(task, count)
    assert len(batch) == count
    assert trainer.commit(batch, step) == []
    return done


def _read(folder: Path) -> Any:
    import pyarrow.dataset as ds

    return ds.dataset(str(folder), format="parquet").to_table().to_pandas()


def test_commit_logs_trained_groups_and_leaves_them_to_the_archiver(
    real_buffer: BufferFactory, tmp_path: Path
) -> None:
    producer = real_buffer("p1", **_archive_settings(tmp_path))
    trainer = real_buffer("trainer", **_archive_settings(tmp_path))
    ids = _produce_and_train(producer, trainer, "math", 3, step=5)
    client = trainer.client
    groups = trainer.keys.groups("math")
    log = client.xrange(trainer.keys.trained("math"))
    in_stream = [e[0] for e in client.xrange(groups)]
    assert [e[1][b"source_id"] for e in log] == in_stream  # acked, kept for the archiver
    assert [e[1][b"group_id"].decode() for e in client.xrange(groups)] == ids
    assert client.xpending(groups, TRAINER)["pending"] == 0
    assert all(e[1][b"train_step"] == b"5" and e[1][b"trained_by"] == b"trainer" for e in log)
    assert int(client.hget(trainer.keys.progress, "math:consumed")) == 3


def test_no_log_without_an_archive(real_buffer: BufferFactory, tmp_path: Path) -> None:
    producer = real_buffer("p1")
    trainer = real_buffer("trainer")
    _produce_and_train(producer, trainer, "math", 2, step=1)
    assert trainer.client.exists(trainer.keys.trained("math")) == 0
    assert trainer.client.xlen(trainer.keys.groups("math")) == 0  # deleted at the commit, as ever


def test_log_is_capped_and_the_trainer_warns(
    real_buffer: BufferFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _archive_settings(tmp_path, keep=5)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    for step in range(1, 4):
        _produce_and_train(producer, trainer, "math", 4, step=step, start=10 * step)
    # no archiver: the log keeps the newest 5, and only their groups stay in Redis
    client = trainer.client
    log = client.xrange(trainer.keys.trained("math"))
    assert len(log) == 5
    assert [e[1][b"source_id"] for e in log] == [e[0] for e in client.xrange(trainer.keys.groups("math"))]
    assert "3 trained groups were deleted unarchived" in caplog.text and "archive.keep 5" in caplog.text


def test_archive_writes_every_trained_group_once_with_its_lineage(
    real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path
) -> None:
    settings = _archive_settings(tmp_path)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    ids = _produce_and_train(producer, trainer, "math", 3, step=2)
    ids += _produce_and_train(producer, trainer, "code", 2, step=3, start=10)
    archiver = create_archiver(tree(**settings), client=trainer.client)
    archiver.ensure()
    archiver.step(0)
    archiver.flush()
    root = tmp_path / "archive"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))
    run = trainer.keys.run
    assert [f.rsplit("/", 1)[0] for f in files] == [
        f"trained/{run}/code/step-00000003",
        f"trained/{run}/math/step-00000002",
    ]
    df = _read(root / "trained")
    assert sorted(set(df["group_id"])) == sorted(ids)
    assert len(df) == 3 * 4 + 2 * 4  # one row per sample
    row = df[(df["group_id"] == "math:u0") & (df["sample_index"] == 1)].iloc[0]
    assert row["run"] == run and row["task"] == "math" and row["uid"] == "u0"
    assert row["prompt"] == "What is 0 + 1?" and list(row["prompt_ids"]) == [1, 2, 3]
    assert list(row["response_ids"]) == list(range(1, 7))
    assert list(row["logprobs"]) == [-0.5] * 6 and list(row["versions"]) == [1] * 6
    assert row["reward"] == 1.0 and row["reward_details"] == '{"score":1.0}'
    assert row["model_step"] == 1 and row["train_step"] == 2 and row["staleness"] == 0
    assert row["fate"] == "trained" and row["producer"] == "p1" and row["finish_reason"] == "stop"
    assert row["prompt_meta"] == '{"answer":"1"}'
    assert row["created_at"] <= row["trained_at"] <= row["archived_at"]
    # archived: the log entries and the groups are deleted
    for task in ("math", "code"):
        assert trainer.client.xlen(trainer.keys.trained(task)) == 0
        assert trainer.client.xpending(trainer.keys.trained(task), ARCHIVE)["pending"] == 0
        assert trainer.client.xlen(trainer.keys.groups(task)) == 0


class ArchiverProcess:
    """`rollstream archive` with its output in files, killed only by its own handle."""

    def __init__(self, env: dict[str, str], folder: Path, name: str) -> None:
        self.err = folder / f"{name}.err"
        with self.err.open("w") as err:
            self.proc = subprocess.Popen(rollstream("archive"), env=env, stdout=err, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def _visible_files_are_whole(root: Path) -> int:
    """Every Parquet file a reader sees opens and reads whole; their number."""
    files = list(root.rglob("*.parquet"))
    for path in files:
        pq.read_table(path)
    return len(files)


def test_archiver_killed_at_any_moment_archives_each_group_exactly_once(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    root = tmp_path / "archive"
    archive = {"keep": 100_000, "dir": str(root), "flush_s": 0.02, "read_count": 8}
    settings = make_settings(redis_server.url, archive=archive)
    client = connect(settings.redis)
    producer = open_buffer(client, settings, "p1")
    trainer = open_buffer(connect(settings.redis), settings, "trainer")
    env = {
        **os.environ,
        "ROLLSTREAM_RUN": settings.run,
        "ROLLSTREAM_REDIS__URL": redis_server.url,
        "ROLLSTREAM_TASKS": json.dumps([{"name": "math", "n": 4}, {"name": "code", "n": 2}]),
        "ROLLSTREAM_BUFFER__CLAIM_IDLE_MS": "1000",
        "ROLLSTREAM_BUFFER__BLOCK_MS": "100",
        **{f"ROLLSTREAM_ARCHIVE__{k.upper()}": str(v) for k, v in archive.items()},
    }
    trained: list[str] = []
    filtered: list[str] = []
    dead: list[str] = []
    step = 0
    uid = 0

    def work(steps: int) -> None:
        nonlocal step, uid
        for _ in range(steps):
            step += 1
            for task, count in (("math", 6), ("code", 3)):
                producer.feed(prompts(task, count + 2, uid))
                uid += count + 2
                claims = producer.claim(task, count + 2)
                for claim in claims[:count]:
                    group = group_for(claim.prompt, n=4, tokens=256, step=step - 1)
                    producer.complete(claim, group)
                    trained.append(claim.group_id)
                filtered_claim, dead_claim = claims[count:]
                producer.drop(filtered_claim)
                filtered.append(filtered_claim.group_id)
                entry = dead_claim.entry
                producer.dead_letter_by_hand("prompts", task, entry.id, "a prompt that crashes the judge")
                dead.append(dead_claim.group_id)
                batch = trainer.read_batch(task, count)
                assert trainer.commit(batch, step) == []

    def pending() -> int:
        total = 0
        for task in ("math", "code"):
            with contextlib.suppress(redis.ResponseError):  # the archiver has not made its group yet
                total += int(client.xpending(trainer.keys.trained(task), ARCHIVE)["pending"])
        return total

    # moments to die at: with entries read and not yet acked; while a file is being
    # written (its temporary name is there); just after a file appeared
    def holding() -> bool:
        return pending() > 0

    def writing() -> bool:
        return any(root.rglob(".part-*.tmp"))

    def renamed(before: int) -> Any:
        return lambda: len(list(root.rglob("*.parquet"))) > before

    work(2)
    kills = 0
    for round_ in range(6):
        # each start reads in batches of another size: the entries read again after a kill
        # make other files than before, which must not archive any of them a second time
        count = {"ROLLSTREAM_ARCHIVE__READ_COUNT": str((8, 5, 3, 7, 4, 6)[round_])}
        archiver = ArchiverProcess({**env, **count}, tmp_path, f"archiver-{round_}")
        work(3)
        before = len(list(root.rglob("*.parquet")))
        moment = (holding, writing, renamed(before))[round_ % 3]
        with contextlib.suppress(AssertionError):  # that moment went by unseen: it dies at another
            wait_for(moment, timeout=60, interval=0.001)
        assert archiver.proc.poll() is None, archiver.err.read_text()[-2000:]
        archiver.kill()
        kills += 1
        _visible_files_are_whole(root)
    work(2)
    archiver = ArchiverProcess(env, tmp_path, "archiver-last")
    wait_for(lambda: all(client.xlen(trainer.keys.trained(t)) == 0 for t in ("math", "code")), timeout=120)
    RunControl(client, trainer.keys).publish(STOP)
    assert archiver.proc.wait(timeout=60) == 0, archiver.err.read_text()[-3000:]
    assert kills == 6

    assert not list(root.rglob(".part-*")), "a temporary file was left behind"
    assert _visible_files_are_whole(root) > 0
    rows = _read(root / "trained")
    per_sample = rows.groupby(["group_id", "sample_index"]).size()
    assert per_sample.max() == 1, per_sample[per_sample > 1].head()
    assert sorted(set(rows["group_id"])) == sorted(trained)
    assert len(rows) == 4 * len(trained)
    assert set(rows["staleness"]) == {0}
    untrained = _read(root / "untrained")
    by_fate = {fate: sorted(part["group_id"]) for fate, part in untrained.groupby("fate")}
    assert by_fate == {"filtered": sorted(filtered), "dead": sorted(dead)}
    assert untrained["reason"].str.contains("a prompt that crashes the judge").sum() == len(dead)
    # everything archived left Redis
    for task in ("math", "code"):
        assert client.xlen(trainer.keys.groups(task)) == 0
        assert client.xpending(trainer.keys.trained(task), ARCHIVE)["pending"] == 0


def test_entries_read_again_after_a_crash_between_rename_and_ack_are_not_written_twice(
    real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _archive_settings(tmp_path, read_count=6)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    ids = _produce_and_train(producer, trainer, "math", 10, step=1)
    first = create_archiver(tree(**settings), client=trainer.client)
    first.ensure()

    class Killed(Exception):
        pass

    def die(*args: Any, **kwargs: Any) -> None:
        raise Killed  # the process dies after its files are in place, before the ack

    monkeypatch.setattr(first, "_ack", die)
    first.step(0)  # reads 6 of the 10
    with pytest.raises(Killed):
        first.flush()
    root = tmp_path / "archive"
    assert len(list(root.rglob("*.parquet"))) == 1
    # the restarted archiver reads in batches of another size: its files are other ones
    restarted = create_archiver(tree(**_archive_settings(tmp_path, read_count=4)), client=trainer.client)
    while restarted.step(0):
        pass
    restarted.flush()
    assert restarted.skipped == 6
    rows = _read(root / "trained")
    assert len(rows) == 10 * 4
    assert rows.groupby(["group_id", "sample_index"]).size().max() == 1
    assert sorted(set(rows["group_id"])) == sorted(ids)
    assert trainer.client.xlen(trainer.keys.groups("math")) == 0


def _archive_a_run(real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path) -> tuple[Path, Any]:
    """Two steps of text prompts and one of chat prompts, archived; the archive's root."""
    settings = _archive_settings(tmp_path)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    chat = [
        Prompt(uid=f"c{i}", task="code", prompt=[{"role": "system", "content": "Be brief."},
               {"role": "user", "content": f"Say {i}."}])
        for i in range(3)
    ]  # fmt: skip
    for step, batch in ((1, prompts("math", 4)), (2, prompts("math", 4, 4)), (3, chat)):
        producer.feed(batch)
        task = batch[0].task
        for claim in producer.claim(task, len(batch)):
            group = group_for(claim.prompt, n=4, tokens=5, step=step - 1)
            for i, sample in enumerate(group.samples):
                sample.text = f"answer {i} to {claim.prompt.uid}"
                sample.reward = {"score": float(i), "judge": "test"}
            producer.complete(claim, group)
        assert trainer.commit(trainer.read_batch(task, len(batch)), step) == []
    archiver = create_archiver(tree(**settings), client=trainer.client)
    archiver.ensure()
    while archiver.step(0):
        pass
    archiver.flush()
    return tmp_path / "archive", trainer


def test_the_archive_reads_as_it_is_with_pandas_pyarrow_duckdb_and_datasets(
    real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path
) -> None:
    pd = require("pandas", "test")
    duckdb = require("duckdb", "test")
    datasets = require("datasets", "test")
    root, _ = _archive_a_run(real_buffer, tree, tmp_path)
    trained = root / "trained"
    frame = pd.read_parquet(trained)
    assert len(frame) == 11 * 4 and frame["reward"].max() == 3.0
    assert len(_read(trained)) == 11 * 4  # pyarrow.dataset
    glob = str(trained / "**" / "*.parquet")
    best = duckdb.sql(
        f"SELECT group_id, max(reward) AS best, count(*) AS n FROM read_parquet('{glob}') GROUP BY group_id"
    ).df()
    assert len(best) == 11 and set(best["best"]) == {3.0} and set(best["n"]) == {4}
    loaded = datasets.load_dataset("parquet", data_files=glob, split="train")
    assert loaded.num_rows == 11 * 4
    row = loaded.filter(lambda r: r["group_id"] == "code:c1" and r["sample_index"] == 2)[0]
    assert orjson.loads(row["prompt_messages"])[1] == {"role": "user", "content": "Say 1."}
    assert row["prompt"] == "Say 1." and row["response"] == "answer 2 to c1"
    assert orjson.loads(row["reward_details"]) == {"score": 2.0, "judge": "test"}
    assert row["train_step"] == 3 and row["staleness"] == 0 and len(row["logprobs"]) == 5


def test_export_writes_sft_and_preference_jsonl_that_datasets_loads(
    real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path
) -> None:
    datasets = require("datasets", "test")
    root, _ = _archive_a_run(real_buffer, tree, tmp_path)
    sft, pref = tmp_path / "sft.jsonl", tmp_path / "pref.jsonl"
    assert main(["export", "--format", "sft", "--archive", str(root), "--task", "math", "--out", str(sft),
                 "--best-of", "2", "--min-reward", "2"]) == 0  # fmt: skip
    records = datasets.load_dataset("json", data_files=str(sft), split="train")
    # text prompts: TRL's prompt-completion form; the best 2 of each group at reward >= 2
    assert records.column_names == ["prompt", "completion"]
    assert records.num_rows == 8 * 2
    assert records[0] == {"prompt": "What is 0 + 1?", "completion": "answer 3 to u0"}
    assert records[1] == {"prompt": "What is 0 + 1?", "completion": "answer 2 to u0"}
    assert main(["export", "--format", "preference", "--archive", str(root), "--out", str(pref)]) == 0
    pairs = datasets.load_dataset("json", data_files=str(pref), split="train")
    # a chat prompt among them: the conversational form for every record
    assert pairs.column_names == ["prompt", "chosen", "rejected"] and pairs.num_rows == 11
    chat = next(r for r in pairs if r["prompt"][-1]["content"] == "Say 2.")
    assert chat["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert chat["chosen"] == [{"role": "assistant", "content": "answer 3 to c2"}]
    assert chat["rejected"] == [{"role": "assistant", "content": "answer 0 to c2"}]
    text = next(r for r in pairs if r["prompt"] == [{"role": "user", "content": "What is 5 + 1?"}])
    assert text["chosen"][0]["content"] == "answer 3 to u5"


def test_groups_kept_for_the_archiver_are_neither_waiting_nor_lag(
    real_buffer: BufferFactory, tmp_path: Path
) -> None:
    from rollstream.cli.status import run_status
    from rollstream.shared.runmetrics import RunCollector, stream_metric

    settings = _archive_settings(tmp_path)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    producer.feed(prompts("math", 5))
    _produce_and_train(producer, trainer, "math", 3, step=1)
    for claim in producer.claim("math", 2):  # two more made, not trained yet
        producer.complete(claim, group_for(claim.prompt))
    assert trainer.client.xlen(trainer.keys.groups("math")) == 5  # 3 of them kept for the archiver
    account = run_status(trainer.client, trainer.keys).accounts["math"]
    assert (account.trained, account.waiting, account.lost) == (3, 2, 0)
    collector = RunCollector(trainer.client, trainer.keys, ["math"], 10.0)
    lag = next(m for m in collector.read() if m.name == stream_metric("groups", "lag"))
    assert [s.value for s in lag.samples if s.labels.get("task") == "math"] == [2.0]


def test_expired_groups_are_archived_whole_with_their_reason(
    real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path
) -> None:
    settings = _archive_settings(tmp_path)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    producer.feed(prompts("math", 2))
    for claim in producer.claim("math", 2):
        producer.complete(claim, group_for(claim.prompt, n=4, tokens=3, step=0))
    batch = trainer.read_batch("math", 2)
    assert trainer.expire(batch.items[0], train_step=9) is not None  # re-rolled from the pool
    assert trainer.discard(batch.items[1], train_step=9)  # tail_batch_trigger_size -1: dropped
    assert trainer.client.xlen(trainer.keys.expired("math")) == 1
    archiver = create_archiver(tree(**settings), client=trainer.client)
    archiver.ensure()
    archiver.step(0)
    archiver.flush()
    rows = _read(tmp_path / "archive" / "untrained")
    assert sorted(set(rows["group_id"])) == ["math:u0", "math:u1"] and set(rows["fate"]) == {"expired"}
    assert len(rows) == 2 * 4  # the samples, as the trainer read them
    assert set(rows["staleness"]) == {8} and set(rows["train_step"]) == {9}
    assert set(rows["reason"]) == {"expired at train step 9: staleness 8 >= stale_threshold 2"}
    third = rows[(rows["group_id"] == "math:u1") & (rows["sample_index"] == 2)].iloc[0]
    assert list(third["response_ids"]) == [2, 3, 4] and third["prompt"] == "What is 1 + 1?"
    assert not (tmp_path / "archive" / "trained").exists()
    assert trainer.client.xlen(trainer.keys.trained("math")) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_through_producer_and_trainer_is_archived_once_while_the_archiver_is_killed(
    redis_server: EmbeddedRedis, run_name: str, tmp_path: Path
) -> None:
    """feed -> `rollstream produce` -> `rollstream train --stop-run` with `rollstream archive`
    beside them, killed with kill -9 three times and restarted: every group the trainer
    committed is archived once with its lineage, every filtered, dead or expired one with
    its reason, and the archive counts what the run's progress counters count."""
    root = tmp_path / "archive"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(
        ROLLSTREAM_REDIS__URL=redis_server.url, ROLLSTREAM_RUN=run_name,
        ROLLSTREAM_TASKS='[{"name": "math", "n": 4}]', ROLLSTREAM_ROLLOUT__BATCH_SIZE="8",
        ROLLSTREAM_ENGINES__SIM__TIME_COMPRESSION="50", ROLLSTREAM_ENGINES__SIM__MEDIAN_TOKENS="64",
        ROLLSTREAM_PRODUCER__MAX_TOKENS="128", ROLLSTREAM_ARCHIVE__KEEP="10000",
        ROLLSTREAM_ARCHIVE__DIR=str(root), ROLLSTREAM_ARCHIVE__FLUSH_S="0.1",
        ROLLSTREAM_ARCHIVE__READ_COUNT="4",
    )  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(f'{{"uid": "q{i}", "prompt": "What is {i} + 2?", "answer": "{i + 2}"}}\n' for i in range(300))
    )
    fed = subprocess.run(
        rollstream("feed", str(path), "--task", "math"), env=env, capture_output=True, text=True
    )
    assert fed.returncode == 0, fed.stderr[-2000:]
    steps = 20
    with (tmp_path / "trainer.err").open("w") as err:
        trainer = subprocess.Popen(
            rollstream("train", "--steps", str(steps), "--step-time", "0.3", "--stop-run"),
            env=env, stdout=err, stderr=subprocess.STDOUT,
        )  # fmt: skip
    with (tmp_path / "producer.err").open("w") as err:
        producer = subprocess.Popen(
            rollstream("produce", "--local-engines"), env=env, stdout=err, stderr=subprocess.STDOUT
        )
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    try:
        kills = 0
        for i in range(3):
            archiver = ArchiverProcess(env, tmp_path, f"archiver-{i}")
            files = len(list(root.rglob("*.parquet")))
            # killed once it has written two more files, mid-way through whatever it does then
            wait_for(
                lambda f=files: len(list(root.rglob("*.parquet"))) > f + 1 or trainer.poll() is not None, 120
            )
            if trainer.poll() is None:
                kills += 1
            archiver.kill()
            _visible_files_are_whole(root)
        assert kills >= 2, "the run ended before the archiver was killed mid-run"
        archiver = ArchiverProcess(env, tmp_path, "archiver-last")
        assert trainer.wait(timeout=240) == 0, (tmp_path / "trainer.err").read_text()[-3000:]
        assert producer.wait(timeout=120) == 0, (tmp_path / "producer.err").read_text()[-3000:]
        # a last archiver started after the run's stop event does not see it: it is stopped
        # with SIGTERM once it has archived what the run left (it writes what it holds first)
        wait_for(lambda: client.xlen(keys.trained("math")) == 0, 120)
        archiver.proc.send_signal(signal.SIGTERM)
        assert archiver.proc.wait(timeout=60) == 0, archiver.err.read_text()[-3000:]
    finally:
        for proc in (trainer, producer):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    progress = {k.decode(): int(float(v)) for k, v in client.hgetall(keys.progress).items()}
    assert int(client.hget(keys.state, "train_step")) == steps
    rows = _read(root / "trained")
    assert rows.groupby(["group_id", "sample_index"]).size().max() == 1
    assert rows["group_id"].nunique() == progress["math:consumed"] == steps * 8
    assert set(rows["train_step"]) == set(range(1, steps + 1))
    assert (rows["staleness"] >= 0).all() and (
        rows["staleness"] == rows["train_step"] - rows["model_step"] - 1
    ).all()
    assert (
        rows["response_ids"].map(len).eq(rows["response_tokens"]).all()
        and rows["prompt"].str.startswith("What is").all()
    )
    assert rows["logprobs"].map(len).eq(rows["response_tokens"]).all()
    untrained = _read(root / "untrained") if (root / "untrained").exists() else None
    counted = {fate: 0 for fate in ("filtered", "dead", "expired")}
    if untrained is not None:
        counted.update(untrained.groupby("fate")["entry_id"].nunique().to_dict())
        assert untrained["reason"].notna().all()
    assert counted["filtered"] == progress.get("math:filtered", 0) == client.xlen(keys.filtered)
    assert counted["dead"] == client.xlen(keys.dead)
    assert counted["expired"] == progress.get("math:expired", 0) + progress.get("math:expired_dropped", 0)
    assert not list(root.rglob(".part-*"))
    # what is left in Redis is what the run made and did not train (its stop came first)
    assert client.xlen(keys.trained("math")) == 0
    left = {e[1][b"group_id"].decode() for e in client.xrange(keys.groups("math"))}
    assert not left & set(rows["group_id"])


def test_an_agent_trajectory_keeps_its_loss_mask_and_turns(
    real_buffer: BufferFactory, tree: SettingsFactory, tmp_path: Path
) -> None:
    settings = _archive_settings(tmp_path)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    producer.feed(prompts("math", 1))
    (claim,) = producer.claim("math", 1)
    turns = [Turn(MODEL, 3, text="call add(2, 3)"), Turn(TOOL, 2, text="5", status="ok", name="add"),
             Turn(MODEL, 1, text="5", reward=1.0)]  # fmt: skip
    samples = [
        Sample([1, 2], [7, 8, 9, 5, 5, 10], [-0.1] * 6, [0] * 6, finish_reason="stop", reward={"score": 1.0},
               text="5", loss_mask=[1, 1, 1, 0, 0, 1], turns=turns, agent_status="done")
        for _ in range(4)
    ]  # fmt: skip
    producer.complete(claim, Group.for_prompt(claim.prompt, samples=samples))
    assert trainer.commit(trainer.read_batch("math", 1), 1) == []
    archiver = create_archiver(tree(**settings), client=trainer.client)
    archiver.ensure()
    archiver.step(0)
    archiver.flush()
    row = _read(tmp_path / "archive" / "trained").iloc[0]
    assert list(row["loss_mask"]) == [1, 1, 1, 0, 0, 1] and row["agent_status"] == "done"
    assert orjson.loads(row["turns"])[1] == {
        "role": "tool",
        "len": 2,
        "text": "5",
        "status": "ok",
        "name": "add",
    }
    assert row["format"] == "1.1"


def test_an_archiver_beside_a_trainer_without_an_archive_says_so(
    real_buffer: BufferFactory,
    tree: SettingsFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollstream.consumer import archive as module

    monkeypatch.setattr(module, "LAG_CHECK_S", 0.0)
    producer = real_buffer("p1")
    trainer = real_buffer("trainer")  # archive.keep 0: no trained log
    archiver = create_archiver(tree(**_archive_settings(tmp_path)), client=trainer.client)
    archiver.ensure()
    archiver.step(0)  # the first look: nothing to compare yet
    _produce_and_train(producer, trainer, "math", 2, step=1)
    archiver.step(0)
    assert "committed 2 groups of task math that did not come to the trained log" in caplog.text
    assert "ROLLSTREAM_ARCHIVE__KEEP for the trainer too" in caplog.text


def test_an_archive_dir_that_cannot_be_written_is_named(
    redis_server: EmbeddedRedis, make_settings: SettingsFactory, real_client: redis.Redis, tmp_path: Path
) -> None:
    from rollstream.shared.errors import SettingsError

    (tmp_path / "file").write_text("not a folder")
    archive = {"keep": 10, "dir": str(tmp_path / "file" / "archive")}
    settings = make_settings(redis_server.url, archive=archive)
    with pytest.raises(SettingsError, match=r"archive\.dir .*file/archive.*cannot be written"):
        run_archiver(settings, threading.Event(), client=real_client)


def test_the_archive_works_on_redis_6_2(
    redis62_server: EmbeddedRedis, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    settings = make_settings(redis62_server.url, **_archive_settings(tmp_path, keep=3))
    producer = open_buffer(connect(settings.redis), settings, "p1")
    trainer = open_buffer(connect(settings.redis), settings, "trainer")
    ids = _produce_and_train(producer, trainer, "math", 2, step=1)
    ids += _produce_and_train(producer, trainer, "math", 2, step=2, start=2)  # the cap deletes one
    assert trainer.client.xlen(trainer.keys.trained("math")) == 3
    archiver = create_archiver(settings, client=trainer.client)
    archiver.ensure()
    archiver.step(0)
    archiver.flush()
    rows = _read(tmp_path / "archive" / "trained")
    assert sorted(set(rows["group_id"])) == sorted(ids[1:])
    assert trainer.client.xlen(trainer.keys.groups("math")) == 0
    assert trainer.client.xlen(trainer.keys.trained("math")) == 0


def test_files_roll_by_size_and_the_archiver_warns_of_its_lag(
    real_buffer: BufferFactory,
    tree: SettingsFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollstream.consumer import archive as module

    monkeypatch.setattr(module, "LAG_CHECK_S", 0.0)
    # a file is closed once its entries hold 1 KiB: each group of 4 x 6 tokens is ~0.5 KiB
    settings = _archive_settings(tmp_path, keep=10, warn_at=0.5, file_mb=1 / 1024, flush_s=3600, read_count=3)
    producer = real_buffer("p1", **settings)
    trainer = real_buffer("trainer", **settings)
    ids = _produce_and_train(producer, trainer, "math", 6, step=1)
    archiver = create_archiver(tree(**settings), client=trainer.client)
    archiver.ensure()
    archiver.step(0)  # 3 read (of 6 waiting: 6 >= 0.5 x 10), one file of them
    assert "6 trained groups in" in caplog.text and "of archive.keep 10" in caplog.text
    archiver.step(0)
    files = sorted((tmp_path / "archive").rglob("*.parquet"))
    assert len(files) == 2 and archiver.sources[0].held == []  # rolled by size, not by time
    assert sorted(set(_read(tmp_path / "archive" / "trained")["group_id"])) == sorted(ids)


def test_a_dead_letter_trimmed_by_its_cap_before_it_was_archived_names_that_cap(
    real_buffer: BufferFactory,
    tree: SettingsFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the dead-letter stream's cap is buffer.dead_maxlen: the warning named archive.keep
    settings = {**_archive_settings(tmp_path), "buffer": {"dead_maxlen": 7}}
    trainer = real_buffer("trainer", **settings)
    trainer.ensure("math")
    first = create_archiver(tree(**settings), client=trainer.client)
    first.ensure()
    trainer.client.xadd(trainer.keys.dead, {"reason": "by hand", "source_id": "1-0"})

    class Killed(Exception):
        pass

    def die(*args: Any, **kwargs: Any) -> None:
        raise Killed

    monkeypatch.setattr(first, "_ack", die)
    first.step(0)  # read, pending under the archiver's name
    with pytest.raises(Killed):
        first.flush()
    trainer.client.xtrim(trainer.keys.dead, maxlen=0)  # the cap trims it meanwhile
    restarted = create_archiver(tree(**settings), client=trainer.client)
    with caplog.at_level(logging.WARNING):
        while restarted.step(0):
            pass
        restarted.flush()
    assert restarted.missing == 1
    assert "deleted by the cap buffer.dead_maxlen 7" in caplog.text and "archive.keep" not in caplog.text
    assert trainer.client.xpending(trainer.keys.dead, "archive")["pending"] == 0
