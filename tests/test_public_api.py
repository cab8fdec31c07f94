"""Every public definition of the package is reached by code outside tests/.

Public: a module-level function or class of streamrl/, workers/ or launcher/ whose name does not
start with ``_``, and the public methods of such classes. Reached: its name is used by the
package, tools/ or the build and run files (pyproject.toml entry points, Makefile, configs/,
docker/, .ci/, tools/ scripts) - as a name, an attribute, an imported name, or a
``module:function`` / dotted string; a definition registered by a ``@register_*`` decorator is
reached through its registry. Production code that only tests use belongs in tests/; a
definition meant for users that the package itself never calls goes in ``ALLOWLIST`` with the
reason.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = ("streamrl", "workers", "launcher")
CODE_ROOTS = (*PACKAGE_ROOTS, "tools")
RUN_FILES = ("pyproject.toml", "Makefile", "configs/**/*.yaml", "docker/*", ".ci/**/*", "tools/**/*.sh")

# Documented user API that nothing in the package calls: "path::name": why it stays public.
ALLOWLIST = {
    "streamrl/security.py::write_keypair": "the README's CURVE setup: users make the key files with it",
    "streamrl/coord/coordinator.py::OutageRetry.call_with_retry": "redis-py calls it around every command (an override)",
}



def reached_names() -> set[str]:
    """Every identifier the non-test code and run files use."""
    names: set[str] = set()
    for root in CODE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.alias):
                    names.add(node.name.rpartition(".")[2])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
                    names.update(re.split(r"[:.\s=]", node.value))  # "pkg.module:function", getattr names
    for pattern in RUN_FILES:
        for path in REPO.glob(pattern):
            if path.is_file():
                names.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    return names


def _registered(node: ast.FunctionDef | ast.ClassDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = getattr(target, "id", None) or getattr(target, "attr", "")
        if name.startswith("register"):
            return True
    return False


def public_definitions() -> list[tuple[str, str]]:
    """``("path::name" or "path::Class.method", name)`` for every public definition."""
    defs = []
    for root in PACKAGE_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for node in ast.parse(path.read_text()).body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if node.name.startswith("_") or _registered(node):
                    continue
                defs.append((f"{rel}::{node.name}", node.name))
                if isinstance(node, ast.ClassDef):
                    defs += [(f"{rel}::{node.name}.{m.name}", m.name) for m in node.body
                             if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_")]
    return defs


def unreached() -> list[str]:
    names = reached_names()
    return sorted(key for key, name in public_definitions() if name not in names)


def test_every_public_definition_is_reached_outside_tests():
    new = [key for key in unreached() if key not in ALLOWLIST]
    assert not new, ("public definitions that only tests (or nothing) use: move them to tests/, delete them, "
                     "make them private, or add documented user API to ALLOWLIST:\n  " + "\n  ".join(new))


def test_lists_name_live_definitions():
    """Allowlisted entries must name a public definition that exists."""
    keys = {key for key, _ in public_definitions()}
    stale = sorted(k for k in ALLOWLIST if k not in keys)
    assert not stale, f"no such public definition, remove: {stale}"


def test_allowlist_gives_reasons():
    assert all(reason.strip() for reason in ALLOWLIST.values())
