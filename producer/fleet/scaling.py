"""How many engines a run has, in its state hash (docs/stream-format.md §6):

    engines_wanted   the count `rollstream engines scale N` asked for; the engines
                     process follows it (and starts with it after a restart)
    engines          the count of engine actors serving, indices 0 .. N-1: written by
                     the engines process once new engines answer, and at once, before
                     they are drained, when engines go; producers follow it
    engines_autoscale  JSON {"min": A, "max": B}: `rollstream engines scale --min A --max B`;
                     the engines process then sets engines_wanted itself (autoscale.py's
                     autoscale_target)
    engines_busy     JSON {"busy": B, "ts": T}: the engines' mean busy fraction at the
                     engines process's last autoscale look (every AUTOSCALE_S), T on
                     the Redis server's clock; what the producers' scaling figure
                     (producer/fleet/demand.py) reads to tell saturated engines

Producers send work only to engines below ``engines``: one above it is being drained
and removed, or not up yet.
"""

from __future__ import annotations

import orjson
import redis

from rollstream.shared.errors import CorruptValueError
from rollstream.shared.keys import Keys
from rollstream.shared.streams import text

ENGINES_WANTED = "engines_wanted"
ENGINES_SERVING = "engines"
ENGINES_AUTOSCALE = "engines_autoscale"
ENGINES_BUSY = "engines_busy"
MAX_ENGINES = 4096  # as engines.count


class EngineCount:
    """Reads and writes the run's engine counts."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def wanted(self) -> int | None:
        return self._read(ENGINES_WANTED)

    def serving(self) -> int | None:
        return self._read(ENGINES_SERVING)

    def want(self, count: int) -> None:
        if not 1 <= count <= MAX_ENGINES:
            raise ValueError(f"an engine count is 1 to {MAX_ENGINES}, not {count}")
        self.client.hset(self.keys.state, ENGINES_WANTED, count)

    def autoscale(self) -> tuple[int, int] | None:
        """The autoscale rule (min, max), or None."""
        raw = self.client.hget(self.keys.state, ENGINES_AUTOSCALE)
        if raw is None:
            return None
        try:
            rule = orjson.loads(raw)
            low, high = int(rule["min"]), int(rule["max"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise CorruptValueError(
                self.keys.state, ENGINES_AUTOSCALE, text(raw), '{"min": A, "max": B}; repair it with '
                "`rollstream engines scale --min A --max B`"
            ) from None  # fmt: skip
        return low, high

    def set_autoscale(self, low: int, high: int) -> None:
        if not 1 <= low <= high <= MAX_ENGINES:
            raise ValueError(f"autoscale needs 1 <= min <= max <= {MAX_ENGINES}, not min {low}, max {high}")
        self.client.hset(self.keys.state, ENGINES_AUTOSCALE, orjson.dumps({"min": low, "max": high}))

    def clear_autoscale(self) -> None:
        self.client.hdel(self.keys.state, ENGINES_AUTOSCALE)

    def publish_busy(self, busy: float) -> None:
        """The engines' mean busy fraction now, stamped with the Redis server's clock."""
        seconds, micros = self.client.time()
        body = {"busy": round(busy, 4), "ts": seconds + micros / 1e6}
        self.client.hset(self.keys.state, ENGINES_BUSY, orjson.dumps(body))

    def set_serving(self, count: int) -> None:
        self.client.hset(self.keys.state, ENGINES_SERVING, count)

    def clear_serving(self) -> None:
        self.client.hdel(self.keys.state, ENGINES_SERVING)

    def _read(self, field: str) -> int | None:
        raw = self.client.hget(self.keys.state, field)
        if raw is None:
            return None
        value = text(raw)
        if not value.isdigit() or not 1 <= int(value) <= MAX_ENGINES:
            raise CorruptValueError(
                self.keys.state, field, value, f"an engine count, 1 to {MAX_ENGINES}; repair it with "
                f"`rollstream engines scale N`"
            )  # fmt: skip
        return int(value)
