"""``rollstream export``: JSONL for supervised (SFT) and preference (DPO) trainers, from
the trained groups of a rollout archive (consumer/archive.py).

- ``sft``: per group, its best ``best_of`` samples by reward (at least ``min_reward``
  when given), one record each: ``{"prompt", "completion"}`` for text prompts,
  ``{"messages": [...the prompt's, {"role": "assistant", ...}]}`` when any prompt is a
  chat: the prompt-completion and conversational forms that TRL's SFTTrainer loads.
- ``preference``: per group, its best and its worst sample when their rewards differ
  (the best at least ``min_reward``): ``{"prompt", "chosen", "rejected"}``, or their
  conversational form (TRL's DPOTrainer).

Groups come out in train-step order; a file is written whole or not at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from rollstream.shared.errors import InputError

KINDS = ("sft", "preference")
COLUMNS = ["run", "task", "group_id", "entry_id", "train_step", "sample_index", "prompt", "prompt_messages",
           "response", "reward"]  # fmt: skip


def read_trained(root: Path, run: str | None = None, task: str | None = None) -> Any:
    """The trained rows of an archive (its root, or its ``trained`` folder) as a pandas
    DataFrame with the columns export needs."""
    try:
        import pyarrow.dataset as ds
    except ImportError:
        raise InputError("export reads Parquet with pyarrow: pip install 'rollstream[archive]'") from None
    folder = root / "trained" if (root / "trained").is_dir() else root
    if not folder.is_dir():
        raise InputError(f"--archive {root}: no such folder")
    dataset = ds.dataset(str(folder), format="parquet")
    if not dataset.files:
        raise InputError(f"--archive {root}: no Parquet file under {folder}")
    condition = None
    for name, value in (("run", run), ("task", task)):
        if value is not None:
            term = ds.field(name) == value
            condition = term if condition is None else condition & term
    return dataset.to_table(columns=COLUMNS, filter=condition).to_pandas()


def _prompt(row: Any) -> tuple[str | None, list[dict[str, Any]] | None]:
    messages, text = row["prompt_messages"], row["prompt"]
    # a missing value is None or NaN, as pandas' string type has it
    return (text if isinstance(text, str) else None), (
        orjson.loads(messages) if isinstance(messages, str) else None
    )


def records(
    frame: Any, kind: str, *, min_reward: float | None = None, best_of: int = 1
) -> list[dict[str, Any]]:
    if kind not in KINDS:
        raise InputError(f"--format {kind!r}: one of {', '.join(KINDS)}")
    if best_of < 1:
        raise InputError(f"--best-of {best_of}: at least 1")
    frame = frame[frame["reward"].notna()]
    chat = bool(frame["prompt_messages"].notna().any()) if len(frame) else False
    out: list[dict[str, Any]] = []
    frame = frame.sort_values(["train_step", "run", "task", "entry_id", "sample_index"], kind="stable")
    for _, group in frame.groupby(["run", "task", "entry_id"], sort=False):
        ranked = group.sort_values(["reward", "sample_index"], ascending=[False, True], kind="stable")
        first = ranked.iloc[0]
        text, messages = _prompt(first)
        if not chat:
            messages = None
        elif messages is None:  # a text prompt among chat ones: one user message
            messages = [{"role": "user", "content": text}]
        if kind == "sft":
            for _, row in ranked.head(best_of).iterrows():
                if min_reward is not None and row["reward"] < min_reward:
                    break
                if messages is not None:
                    out.append({"messages": [*messages, {"role": "assistant", "content": row["response"]}]})
                else:
                    out.append({"prompt": text, "completion": row["response"]})
        else:
            best, worst = ranked.iloc[0], ranked.iloc[-1]
            if best["reward"] <= worst["reward"]:
                continue
            if min_reward is not None and best["reward"] < min_reward:
                continue
            if messages is not None:
                out.append({
                    "prompt": messages,
                    "chosen": [{"role": "assistant", "content": best["response"]}],
                    "rejected": [{"role": "assistant", "content": worst["response"]}],
                })  # fmt: skip
            else:
                out.append({"prompt": text, "chosen": best["response"], "rejected": worst["response"]})
    return out


def export_jsonl(
    root: Path,
    out: Path,
    *,
    kind: str,
    run: str | None = None,
    task: str | None = None,
    min_reward: float | None = None,
    best_of: int = 1,
) -> int:
    """Write the records of ``kind`` from the archive at ``root`` to ``out``; their number."""
    rows = records(read_trained(root, run, task), kind, min_reward=min_reward, best_of=best_of)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return len(rows)
