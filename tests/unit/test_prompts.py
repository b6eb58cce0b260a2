from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.producer.prompts import parse_prompt, read_prompt_file
from rollstream.shared.errors import InputError, PromptFileError


def parse(line: str):  # type: ignore[no-untyped-def]
    return parse_prompt(line.encode(), path="p.jsonl", line=3, task="math")


def test_text_prompt_with_meta_and_uid() -> None:
    prompt = parse('{"uid": 7, "prompt": "1+1?", "meta": {"answer": "2"}}')
    assert (prompt.uid, prompt.task, prompt.prompt, prompt.meta) == ("7", "math", "1+1?", {"answer": "2"})


def test_chat_prompt_and_extra_keys_fold_into_meta() -> None:
    prompt = parse('{"messages": [{"role": "user", "content": "hi"}], "answer": "42", "meta": {"level": 3}}')
    assert prompt.prompt == [{"role": "user", "content": "hi"}]
    assert prompt.meta == {"answer": "42", "level": 3}


def test_uid_from_content_is_stable_and_distinct() -> None:
    a, b, c = (
        parse('{"prompt": "x", "answer": 1}'),
        parse('{"answer": 1, "prompt": "x"}'),
        parse('{"prompt": "y"}'),
    )
    assert a.uid == b.uid != c.uid


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"uid": "a"}', "exactly one of the fields 'prompt'"),
        ('{"prompt": "a", "messages": []}', "exactly one of the fields 'prompt'"),
        ('{"prompt": 5}', "field 'prompt' must be a non-empty string, got int"),
        ('{"messages": [{"content": "hi"}]}', "field 'messages[0].role'"),
        ('{"messages": "hi"}', "field 'messages' must be a non-empty list"),
        ('{"prompt": "a", "meta": [1]}', "field 'meta' must be an object, got list"),
        ('{"prompt": "a", "uid": true}', "field 'uid'"),
        ('{"prompt": "a", "prompt_ids": [1, "2"]}', "field 'prompt_ids'"),
    ],
)
def test_bad_line_names_file_line_and_field(line: str, what: str) -> None:
    with pytest.raises(PromptFileError) as info:
        parse(line)
    assert str(info.value).startswith("p.jsonl:3: ")
    assert what in str(info.value)


def test_read_prompt_file_skips_blank_lines_and_counts_real_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": 1}\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl:4: field 'prompt'"):
        read_prompt_file(path, "math")
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert [p.prompt for p in read_prompt_file(path, "math")] == ["a", "b"]


def test_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        read_prompt_file(tmp_path / "nope.jsonl", "math")
