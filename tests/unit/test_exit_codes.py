"""The documentation's table of exit statuses names every status the CLI exits with."""

from __future__ import annotations

import re

from rollstream.cli import main
from tests.helpers import documentation


def test_the_readme_table_has_every_exit_status() -> None:
    codes = {v for name, v in vars(main).items() if name.startswith("RET_") and isinstance(v, int)}
    assert codes >= {0, 1, 2, 3, 4, 5}
    text = documentation()
    start = text.index("Every `rollstream` command exits with one of these")
    section = text[start : text.index("RestartPreventExitStatus=5", start)]
    table = {int(code) for code in re.findall(r"^\| (\d+) \| ", section, re.M)}
    assert codes <= table, f"exit statuses missing from the README's table: {sorted(codes - table)}"
