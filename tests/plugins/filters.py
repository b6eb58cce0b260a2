"""A plug-in group filter, ``producer.is_valid = "tests.plugins.filters:even_answers"``:
keeps the groups of prompts whose answer is even (tests.helpers.prompts: uid u{i},
answer i + 1)."""

from __future__ import annotations

from rollstream.producer.filters import Group


def even_answers(group: Group) -> bool:
    return int(group.prompt.meta["answer"]) % 2 == 0
