"""Write docs/config.md: every section and field of ``streamrl.config.Config`` with its type, default and doc.

The field docs are the attribute docstrings in ``streamrl/config.py`` (the string literal right after
each field); the dataclasses give the names, types and defaults. The output is deterministic, so
``tests/test_config_reference.py`` can compare it with the committed file.

    python tools/gen_config_reference.py            # rewrite docs/config.md
    python tools/gen_config_reference.py --check    # exit 1 when docs/config.md is out of date
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import streamrl.config as config_module

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "config.md"
REGENERATE = "python tools/gen_config_reference.py  (or: make docs)"


def attribute_docs(source: str) -> dict[str, dict[str, str]]:
    """Map class name -> {field name: the docstring that follows the field}, from the module source."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        body = node.body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                fields[stmt.target.id] = inspect.cleandoc(nxt.value.value)
        docs[node.name] = fields
    return docs


def default_text(f: dataclasses.Field) -> str:
    """The field's default as it would be written in YAML-ish form (factories are called)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def cell(text: str) -> str:
    """One Markdown table cell: no newlines, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole docs/config.md text."""
    docs = attribute_docs(Path(config_module.__file__).read_text())
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the field docstrings in streamrl/config.py by tools/gen_config_reference.py;",
        f"     do not edit by hand. Regenerate: {REGENERATE} -->",
        "",
        "A run is configured by one YAML file (`--config configs/tiny.yaml`) plus `section.field=value`",
        "overrides on the `streamrl-launch` command line. Every field below has a default; a config file",
        "only names what it changes. Unknown fields and bad values fail at load time with an error that",
        "names the dotted field and the value.",
        "",
    ]
    sections = dataclasses.fields(config_module.Config)
    lines += ["Sections: " + ", ".join(f"[`{s.name}`](#{s.name})" for s in sections) + ".", ""]
    for section in sections:
        cls = section.default_factory
        lines += [f"## {section.name}", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            lines += [" ".join(inspect.cleandoc(cls.__doc__).split()), ""]
        lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
        field_docs = docs.get(cls.__name__, {})
        for f in dataclasses.fields(cls):
            doc = field_docs.get(f.name, "")
            type_text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            lines.append(
                f"| `{section.name}.{f.name}` | `{cell(type_text)}` | `{cell(default_text(f))}` | {cell(doc)} |"
            )
        lines.append("")
    return "\n".join(lines)


def undocumented() -> list[str]:
    """Dotted names of fields without a docstring."""
    docs = attribute_docs(Path(config_module.__file__).read_text())
    missing = []
    for section in dataclasses.fields(config_module.Config):
        cls = section.default_factory
        for f in dataclasses.fields(cls):
            if not docs.get(cls.__name__, {}).get(f.name):
                missing.append(f"{section.name}.{f.name}")
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date, write nothing")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date; regenerate it with: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
