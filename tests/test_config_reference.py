"""docs/config.md is generated from streamrl/config.py's field docstrings and must be current."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import streamrl.config as config_module

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "tools" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_up_to_date():
    gen = _generator()
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == gen.render(), f"docs/config.md is out of date; regenerate it with: {gen.REGENERATE}"


def test_every_config_field_has_a_docstring_and_a_row():
    gen = _generator()
    assert gen.undocumented() == [], "fields without a docstring in streamrl/config.py"
    text = gen.render()
    for section in dataclasses.fields(config_module.Config):
        for f in dataclasses.fields(section.default_factory):
            assert f"| `{section.name}.{f.name}` |" in text


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    gen = _generator()
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert "make docs" in capsys.readouterr().err
    assert gen.main(["--out", str(stale)]) == 0
    assert gen.main(["--check", "--out", str(stale)]) == 0
