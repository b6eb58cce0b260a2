"""A replay buffer built from the sections it uses, with no settings tree anywhere (issue
22's narrow constructors): the buffer section's knobs, the archive's trained log and the
rollout's stale_threshold each reach the buffer's Redis writes; on fakeredis."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import redis

import rollstream.shared
from rollstream.shared.buffer import ReplayBuffer
from rollstream.shared.buffer_types import Batch
from rollstream.shared.keys import PRODUCERS, Keys
from rollstream.shared.runconfig import open_buffer
from rollstream.shared.settings import ArchiveSettings, BufferSettings
from tests.conftest import SettingsFactory
from tests.helpers import group_for, prompts, wait_idle

SHARED = Path(rollstream.shared.__path__[0])


def test_a_buffer_of_sections_claims_completes_reads_and_commits(fake_client: redis.Redis) -> None:
    keys = Keys("sections")
    producer = ReplayBuffer(fake_client, keys, BufferSettings(summary=True), "p1")
    trainer = ReplayBuffer(fake_client, keys, BufferSettings(), "trainer")
    assert producer.feed(prompts("math", 3)).added == 3
    for claim in producer.claim("math", 3):
        assert producer.complete(claim, group_for(claim.prompt)) is not None
    (_, fields), *_ = fake_client.xrange(keys.groups("math"))
    assert b"summary" in fields  # buffer.summary, from the section
    batch = trainer.read_batch("math", 3)
    assert len(batch) == 3
    assert trainer.commit(batch, 1) == []
    assert fake_client.xlen(keys.groups("math")) == 0  # no archive: deleted at the commit
    assert not fake_client.exists(keys.trained("math"))


def test_the_section_s_claim_idle_ms_and_max_attempts_govern_reclaim(fake_client: redis.Redis) -> None:
    keys = Keys("sections")
    section = BufferSettings(claim_idle_ms=200, max_attempts=1)
    dead = ReplayBuffer(fake_client, keys, section, "dead")
    heir = ReplayBuffer(fake_client, keys, section, "heir")
    dead.feed(prompts("math", 1))
    assert len(dead.claim("math", 1)) == 1
    wait_idle(fake_client, keys.prompts("math"), PRODUCERS, 200)
    assert heir.claim("math", 1) == []  # a second delivery passes max_attempts 1: dead-lettered
    ((_, letter),) = fake_client.xrange(keys.dead)
    assert b"max_attempts 1" in letter[b"reason"]


def test_an_archive_section_keeps_a_trained_log_and_names_the_stale_threshold(
    fake_client: redis.Redis,
) -> None:
    keys = Keys("sections")
    producer = ReplayBuffer(fake_client, keys, BufferSettings(), "p1")
    trainer = ReplayBuffer(
        fake_client, keys, BufferSettings(), "trainer", archive=ArchiveSettings(keep=100), stale_threshold=3
    )
    producer.feed(prompts("math", 2))
    for claim in producer.claim("math", 2):
        producer.complete(claim, group_for(claim.prompt, step=0))
    first, second = trainer.read_batch("math", 2).items
    assert trainer.expire(first, train_step=9) is not None
    assert trainer.commit(Batch("math", [second]), 9) == []
    log = [fields for _, fields in fake_client.xrange(keys.trained("math"))]
    assert [entry[b"fate"] for entry in log if b"fate" in entry] == [b"expired"]
    (expired,) = [entry for entry in log if b"fate" in entry]
    assert expired[b"reason"] == b"expired at train step 9: staleness 8 >= stale_threshold 3"
    assert len(log) == 2 and fake_client.xlen(keys.groups("math")) == 1  # kept for the archiver


def test_a_trained_log_without_the_stale_threshold_is_refused(fake_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="stale_threshold"):
        ReplayBuffer(fake_client, Keys("r"), BufferSettings(), "trainer", archive=ArchiveSettings(keep=5))


def test_open_buffer_hands_the_buffer_its_sections_of_the_tree(
    fake_client: redis.Redis, make_settings: SettingsFactory
) -> None:
    settings = make_settings(archive={"keep": 7}, rollout={"max_staleness": 2})
    buffer = open_buffer(fake_client, settings, "p1")
    assert buffer.keys.run == settings.run and buffer.consumer == "p1"
    assert buffer.buffer_settings is settings.buffer
    assert buffer.trained_log.settings is settings.archive
    assert buffer.trained_log.stale_threshold == settings.rollout.stale_threshold == 3
    assert not hasattr(buffer, "settings")


def test_no_buffer_module_imports_the_settings_tree() -> None:
    modules = sorted(SHARED.glob("buffer*.py"))
    assert len(modules) >= 5
    for path in modules:
        imported = {
            alias.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert "Settings" not in imported, f"{path.name} imports the root Settings"
        assert len(path.read_text().splitlines()) <= 500, f"{path.name} is over 500 lines"
