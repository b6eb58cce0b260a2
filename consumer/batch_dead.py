"""The prompts of a coordinator batch that went to the dead letters (delivered
``max_attempts`` times, undecodable): settled without a result, so that finalizing the
batch does not wait for them for ever (an eval batch with no timeout did).

A batch's prompts carry the uid ``{batch_id}/{uid}`` (consumer/coordinator.py), and a
dead letter keeps the entry's fields, ``uid`` among them (docs/stream-format.md); the
dead-letter stream is read from where it stood when the batch was submitted."""

from __future__ import annotations

from typing import Any

DEAD_FROM = "dead_from"  # field of the batch's hash: the dead-letter stream's last id at submit


class BatchDeadLetters:
    def __init__(self, client: Any, dead_stream: str) -> None:
        self.client = client
        self.stream = dead_stream
        self._seen: dict[str, tuple[str, set[bytes]]] = {}  # batch id -> (read up to, uids)

    def mark(self, batch_key: str) -> None:
        """Where the batch's dead letters will start (called before its prompts are fed)."""
        last = self.client.xrevrange(self.stream, count=1)
        self.client.hset(batch_key, DEAD_FROM, last[0][0] if last else b"0-0")

    def of(self, batch_id: str, batch_key: str) -> set[bytes]:
        """The uids of the batch's prompts dead-lettered so far."""
        start, uids = self._seen.get(batch_id) or (None, set())
        if start is None:
            raw = self.client.hget(batch_key, DEAD_FROM)
            start = raw.decode() if raw else "0-0"
        prefix = f"{batch_id}/".encode()
        for entry_id, fields in self.client.xrange(self.stream, min=f"({start}"):
            uid = fields.get(b"uid", b"")
            if uid.startswith(prefix):
                uids.add(uid)
            start = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self._seen[batch_id] = (start, uids)
        return uids

    def forget(self, batch_id: str) -> None:
        self._seen.pop(batch_id, None)
