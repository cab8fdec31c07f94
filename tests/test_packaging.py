"""Packaging: subpackage list matches the folders; no generic top-level names installed."""
from __future__ import annotations

import tomllib
from pathlib import Path


def test_package_list_matches_folders(repo):
    meta = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(meta["packages"])
    found = {"streamrl." + p.parent.relative_to(repo / "streamrl").as_posix().replace("/", ".")
             for p in (repo / "streamrl").rglob("__init__.py") if p.parent != repo / "streamrl"}
    found |= {"streamrl", "streamrl.workers", "streamrl.launcher"}
    assert declared == found
    assert meta["package-dir"]["streamrl.workers"] == "workers"
    assert meta["package-dir"]["streamrl.launcher"] == "launcher"


def test_no_generic_top_level_modules_importable(repo, python):
    import subprocess

    out = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('workers'), u.find_spec('launcher'))"],
                         cwd="/", capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None None", out.stdout + out.stderr
