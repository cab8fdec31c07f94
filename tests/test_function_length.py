"""Function length in streamrl/, workers/ and launcher/ (read with ``ast``): none over 80 lines,
at most 5 over 60. A function's length runs from its ``def`` line to its last line, docstring
and nested functions included (decorators not)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("streamrl", "workers", "launcher")
HARD_LIMIT = 80
SOFT_LIMIT = 60
MAX_OVER_SOFT = 5



def function_lengths() -> dict[str, int]:
    """``{"path::name": lines}`` for every function and method (nested ones too)."""
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{rel}::{node.name}"
                    out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def _listing(rows: dict[str, int]) -> str:
    return "\n".join(f"  {n:4d} {k}" for k, n in sorted(rows.items(), key=lambda kv: -kv[1]))


def test_no_function_over_the_hard_limit():
    over = {k: n for k, n in function_lengths().items() if n > HARD_LIMIT}
    assert not over, f"functions over {HARD_LIMIT} lines (split them):\n{_listing(over)}"


def test_few_functions_over_the_soft_limit():
    over = {k: n for k, n in function_lengths().items() if n > SOFT_LIMIT}
    assert len(over) <= MAX_OVER_SOFT, (
        f"{len(over)} functions over {SOFT_LIMIT} lines, at most {MAX_OVER_SOFT}:\n{_listing(over)}")
