"""The plug-in pages' examples run, and each page shows its example file verbatim.

Every page of docs/plugins/ names one file of docs/examples/ and quotes it whole in a fenced
``python title=docs/examples/NAME.py`` block; the test runs that file as a user would (from the
repository root, docs/examples on PYTHONPATH so ``module:function`` plug-in names resolve).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs" / "plugins").glob("*.md"))
BLOCK = re.compile(r"```python title=(docs/examples/\w+\.py)\n(.*?)```", re.S)


def _examples() -> list[tuple[Path, str, str]]:
    return [(page, name, body) for page in PAGES for name, body in BLOCK.findall(page.read_text())]


def test_every_plugin_page_quotes_an_example():
    assert {p.stem for p in PAGES} >= {"rewards", "tasks", "datasets", "environments", "models"}
    quoted = {page for page, _, _ in _examples()}
    assert quoted == set(PAGES), f"pages without an example block: {sorted(set(PAGES) - quoted)}"


@pytest.mark.parametrize("page,name,body", _examples(), ids=lambda x: x.name if isinstance(x, Path) else None)
def test_example_is_quoted_verbatim_and_runs(page, name, body):
    path = REPO / name
    assert body == path.read_text(), f"{page.name} quotes {name} but the block differs from the file"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "docs" / "examples"),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# docs/docker.md belongs to the Docker documentation, which is written and tested apart from these pages.
LINKED_ELSEWHERE = {"docs/docker.md"}


def test_relative_links_in_readme_and_docs_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            if path.relative_to(REPO).as_posix() not in LINKED_ELSEWHERE and not path.exists():
                missing.append(f"{page.relative_to(REPO)} -> {target}")
    assert missing == []


def test_paths_named_in_the_readme_exist():
    """Repository paths (configs, tools, docs, docker) that README.md and docs/benchmarks.md name are real files."""
    text = (REPO / "README.md").read_text() + (REPO / "docs" / "benchmarks.md").read_text()
    named = set(re.findall(r"(?<![\w/])((?:configs|tools|docs|docker)/[\w./-]+\.(?:yaml|py|sh|md|json|png))", text))
    assert named, "the README names no paths"
    assert [p for p in sorted(named) if not (REPO / p).exists() and p not in LINKED_ELSEWHERE] == []
