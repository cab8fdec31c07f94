"""Prompt datasets from files: JSONL, Parquet and local Hugging Face ``datasets`` folders.

Every row becomes a :class:`~streamrl.tasks.registry.Problem`:

* ``prompt_key`` (config ``data.prompt_key``) holds the prompt: plain text, or chat messages
  (a list of ``{"role": ..., "content": ...}``), kept in ``Problem.messages`` with
  ``Problem.prompt`` set to the last user message;
* ``answer_key`` (``data.answer_key``) holds the reference answer (a string or a number;
  numbers are written as text, ``3`` and not ``3.0`` for whole floats);
* every other column of the row goes into ``Problem.fields`` for reward functions.

Formats, by path: a folder written by ``Dataset.save_to_disk`` (or a ``DatasetDict``: the
``split`` is taken), ``*.parquet``, anything else is read as JSON Lines. Errors name the
file, the row and the missing key.

Examples:
    >>> problems = load_problems("data/train.parquet", prompt_key="question", answer_key="solution")
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable

from streamrl.tasks.registry import Problem


def _jsonl_rows(path: Path) -> Iterable[tuple[str, Any]]:
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None


def _parquet_rows(path: Path) -> Iterable[tuple[str, Any]]:
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own types for bad files
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _hf_rows(path: Path, split: str) -> Iterable[tuple[str, Any]]:
    import datasets  # noqa: PLC0415 (heavy import; only for folder datasets)

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"{path}: not a Hugging Face datasets folder (save_to_disk) ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: has splits {sorted(ds)}, not data.split = {split!r}")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield f"{path} row {i}", row


def read_rows(path: str | Path, split: str = "train", field: str = "data.path") -> list[tuple[str, Any]]:
    """``[(where, row)]`` of a JSONL file, Parquet file or datasets folder; ``where`` names
    the file and the line or row, for error messages."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{field} = {str(path)!r} does not exist")
    if p.is_dir():
        return list(_hf_rows(p, split))
    if p.suffix == ".parquet":
        return list(_parquet_rows(p))
    return list(_jsonl_rows(p))


def _answer_text(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


def _messages(value: Any, where: str, key: str) -> tuple[dict[str, str], ...]:
    msgs = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: '{key}' is a list but not chat messages "
                             "(each needs a string 'role' and 'content')")
        msgs.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError(f"{where}: '{key}' holds no user message")
    return tuple(msgs)


def row_to_problem(row: Any, where: str, prompt_key: str = "prompt", answer_key: str = "answer") -> Problem:
    """One row -> a Problem (see the module doc); raises naming ``where`` and the key."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with '{prompt_key}' and '{answer_key}', "
                         f"got {type(row).__name__}")
    for key, what in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in row or row[key] is None:
            raise ValueError(f"{where}: no '{key}' ({what}); the row has {sorted(row)}")
    prompt, messages = row[prompt_key], None
    if isinstance(prompt, list):
        messages = _messages(prompt, where, prompt_key)
        prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    elif not isinstance(prompt, str):
        raise ValueError(f"{where}: '{prompt_key}' must be text or chat messages, got {type(prompt).__name__}")
    answer = row[answer_key]
    if isinstance(answer, (dict, list)):
        raise ValueError(f"{where}: '{answer_key}' must be text or a number, got {type(answer).__name__}")
    fields = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return Problem(prompt=prompt, answer=_answer_text(answer), fields=MappingProxyType(fields), messages=messages)


def load_problems(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", split: str = "train",
                  field: str = "data.path") -> list[Problem]:
    """Every row of ``path`` as a Problem; raises ValueError naming the file when it has none."""
    problems = [row_to_problem(row, where, prompt_key, answer_key) for where, row in read_rows(path, split, field)]
    if not problems:
        raise ValueError(f"{field} = {str(path)!r} holds no problems")
    return problems


def check_dataset_columns(cfg) -> list[str]:
    """One line per prompt file of ``cfg`` (``data.path``, ``eval.dataset``) whose rows lack the
    prompt or answer column (``data.prompt_key`` / ``data.answer_key``) or cannot be read; for
    ``--dry-run``, so a run does not start only to fail in its first rollout. Missing files are
    left to the input check that names them."""
    d = cfg.data
    out = []
    for field, path in (("data.path", d.path), ("eval.dataset", cfg.eval.dataset)):
        if not path or not Path(path).expanduser().exists():
            continue
        try:
            load_problems(Path(path).expanduser(), d.prompt_key, d.answer_key, d.split, field=field)
        except ValueError as e:
            out.append(f"config field '{field}' = {str(path)!r}: {e}")
    return out
