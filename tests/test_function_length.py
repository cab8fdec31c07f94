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

# TEMPORARY: functions over the hard limit that their owners are splitting. Empty it.
PENDING_OVER_HARD = {
    "streamrl/learner/trainer.py::_minibatch_pass",
    "streamrl/engines/hf_fast.py::__init__",
    "streamrl/bench/learner.py::run_child",
    "streamrl/envs/episode.py::run_episodes",
    "streamrl/weights/subscriber.py::_fetch",
    "streamrl/bench/rollout.py::bench_pair",
    "streamrl/bench/hf_fast.py::bench_fast_vs_generate",
    "streamrl/algorithms/advantages.py::token_group_advantages",
    "workers/rollout.py::run",
    "streamrl/bench/learner_step.py::main",
}
# TEMPORARY: how many functions over the soft limit the pending splits leave; lower it to MAX_OVER_SOFT.
PENDING_MAX_OVER_SOFT = 21


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
    over = {k: n for k, n in function_lengths().items() if n > HARD_LIMIT and k not in PENDING_OVER_HARD}
    assert not over, f"functions over {HARD_LIMIT} lines (split them):\n{_listing(over)}"


def test_few_functions_over_the_soft_limit():
    over = {k: n for k, n in function_lengths().items() if n > SOFT_LIMIT}
    allowed = max(MAX_OVER_SOFT, PENDING_MAX_OVER_SOFT)
    assert len(over) <= allowed, f"{len(over)} functions over {SOFT_LIMIT} lines, at most {allowed}:\n{_listing(over)}"


def test_pending_entries_are_still_long():
    """A split pending function must leave the list (so that it cannot grow back unseen)."""
    lengths = function_lengths()
    done = sorted(k for k in PENDING_OVER_HARD if lengths.get(k, 0) <= HARD_LIMIT)
    assert not done, f"no longer over {HARD_LIMIT} lines, remove from PENDING_OVER_HARD: {done}"
