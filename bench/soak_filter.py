"""The soak's group filter (``producer.is_valid = "bench.soak_filter:drop_one_in_ten"``):
drops the groups of one prompt in ten (by a hash of its uid), so that the run's filtered
stream takes a steady flow of records and its cap shows in the soak."""

from __future__ import annotations

import zlib

from rollstream.producer.filters import Group


def drop_one_in_ten(group: Group) -> bool:
    return zlib.crc32(group.prompt.uid.encode()) % 10 != 0
