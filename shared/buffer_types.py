"""What the replay buffer hands out and takes back: a producer's claim on a pool entry,
the trainer's batch of groups, a feed's counts, and the small rules that go with them
(the coordinator batch an eval prompt names, the error that stops a reader at a stream
format it does not read)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from rollstream.shared.errors import FormatError, ReplayBufferError
from rollstream.shared.keys import Count
from rollstream.shared.records import Group, Prompt, Sample, Status
from rollstream.shared.streams import Entry

BATCH_META = "rollstream_batch"  # the coordinator batch a prompt belongs to, in its meta
# The counter of a group dropped by the trainer side without being re-queued, by its status
DROPPED_COUNT = {Status.EXPIRED: Count.EXPIRED_DROPPED, Status.ABORTED: Count.ABORTED_DROPPED}


def eval_batch(prompt: Prompt) -> str:
    batch = prompt.meta.get(BATCH_META)
    if not isinstance(batch, str):
        raise ReplayBufferError(f"eval prompt {prompt.uid!r} names no batch in meta[{BATCH_META!r}]")
    return batch


def refused_format(exc: FormatError, entry: Entry) -> FormatError:
    """The error that stops a reader at an entry of a stream-format major it does not
    read: it names the entry and the operator's two ways on. The entry is not
    dead-lettered (the data is fine, the reader is the wrong one): it stays pending
    under this consumer, and a restart of the same reader stops on it again."""
    kind = entry.kind + ":" + entry.task
    return FormatError(
        f"{entry.stream} entry {entry.id}: {exc}; it stays pending for this consumer. To go on "
        f"without it: rollstream dead-letter {kind} {entry.id} --reason 'format not read'"
    )


def default_consumer_name(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class Claim:
    """A pool entry a producer holds until it settles it."""

    entry: Entry
    prompt: Prompt
    previous: Group | None = None  # the aborted / expired group, with any kept samples

    @property
    def task(self) -> str:
        return self.entry.task

    @property
    def group_id(self) -> str:
        return self.previous.group_id if self.previous is not None else self.prompt.group_id

    @property
    def source(self) -> str:
        return self.entry.kind

    @property
    def partial(self) -> list[Sample]:
        return [] if self.previous is None else self.previous.samples


@dataclass(slots=True)
class BatchItem:
    entry: Entry
    group: Group


@dataclass(slots=True)
class Batch:
    """Groups read by the trainer; they stay pending until committed."""

    task: str
    items: list[BatchItem] = field(default_factory=list)

    @property
    def groups(self) -> list[Group]:
        return [item.group for item in self.items]

    def __len__(self) -> int:
        return len(self.items)


@dataclass(slots=True)
class FeedResult:
    added: int
    existing: int
