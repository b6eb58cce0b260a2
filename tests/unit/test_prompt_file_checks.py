"""Prompt files a new user gets wrong: each is refused with the file, the line and what
is wrong, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.producer.feeder import Feeder
from rollstream.producer.prompts import read_prompt_file
from rollstream.shared.errors import InputError, PromptFileError


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_uid_twice_names_both_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path, '{"uid": "a", "prompt": "x"}', '{"uid": "b", "prompt": "y"}', '{"uid": "a", "prompt": "z"}'
    )
    with pytest.raises(PromptFileError, match=r"p.jsonl:3: uid 'a' again: line 1 has it already"):
        read_prompt_file(path, "math")


def test_first_uid_wins_keeps_the_first_and_skips_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path, '{"uid": "a", "prompt": "x"}', '{"uid": "a", "prompt": "z"}')
    (prompt,) = read_prompt_file(path, "math", first_uid_wins=True)
    assert prompt.prompt == "x"


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no prompts in the file"):
        read_prompt_file(write(tmp_path, "", "  "), "math")


def test_a_directory_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a directory"):
        read_prompt_file(tmp_path, "math")


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (
            '{"messages": [{"role": "usr", "content": "hi"}]}',
            "messages[0].role' is 'usr'; allowed: system, user",
        ),
        ('{"messages": [{"role": "user", "content": ["hi"]}]}', "messages[0].content[0]' must be an object"),
        ('{"prompt": "x", "prompt_ids": [1, 4294967296]}', "token ids from 0 to 2147483647"),
        ('{"prompt": "x", "prompt_ids": [-1]}', "token ids from 0 to 2147483647"),
        (
            '{"prompt": "x", "answer": "1", "meta": {"answer": "2"}}',
            "'answer' is given at the top level and in",
        ),
    ],
)
def test_bad_rows_name_the_line_and_field(tmp_path: Path, line: str, what: str) -> None:
    path = write(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(PromptFileError) as caught:
        read_prompt_file(path, "math")
    assert str(caught.value).startswith(f"{path}:2: ") and what in str(caught.value)


def test_the_same_answer_at_the_top_level_and_in_meta_is_fine(tmp_path: Path) -> None:
    (prompt,) = read_prompt_file(
        write(tmp_path, '{"prompt": "x", "answer": "1", "meta": {"answer": "1"}}'), "m"
    )
    assert prompt.meta == {"answer": "1"}


def test_a_feeder_refuses_a_file_that_changed_under_it(tmp_path: Path, fake_buffer: object) -> None:
    path = write(tmp_path, '{"uid": "a", "prompt": "x"}', '{"uid": "b", "prompt": "y"}')
    feeder = Feeder(fake_buffer("feeder"), path, "math", keep_ahead=1)  # type: ignore[operator]
    path.write_text('{"uid": "c", "prompt": "a much longer prompt than before"}\n')
    with pytest.raises(InputError, match="changed since the feeder read it"):
        feeder.run()


def test_a_feeder_refuses_a_uid_twice(tmp_path: Path, fake_buffer: object) -> None:
    path = write(tmp_path, '{"uid": "a", "prompt": "x"}', '{"uid": "a", "prompt": "y"}')
    with pytest.raises(PromptFileError, match="uid 'a' again: line 1"):
        Feeder(fake_buffer("feeder"), path, "math")  # type: ignore[operator]
