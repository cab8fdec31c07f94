#!/usr/bin/env python3
"""Print the image's pip requirements from pyproject.toml: the project's dependencies (with
the torch requirement replaced by --torch), those of --extras, and the build backend (the image
installs the project from source with --no-build-isolation, so setuptools must be in the
wheelhouse). One requirement a line, for ``pip wheel -r`` and ``pip install -r``."""
from __future__ import annotations

import argparse
import re
import tomllib


def requirements(pyproject: dict, torch_spec: str, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"--extras {','.join(unknown)}: not in [project.optional-dependencies] {sorted(optional)}")
    deps = list(project["dependencies"]) + [d for e in extras for d in optional[e]]
    name = re.compile(r"^\s*([A-Za-z0-9_.-]+)")
    kept = [d for d in deps if name.match(d).group(1).lower() != "torch"]
    return [torch_spec, *kept, *pyproject["build-system"]["requires"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pyproject")
    p.add_argument("--torch", default="torch==2.13.0", help="torch requirement (default torch==2.13.0)")
    p.add_argument("--extras", default="", help="comma-separated project extras, e.g. vllm-cpu,smol")
    a = p.parse_args()
    with open(a.pyproject, "rb") as f:
        doc = tomllib.load(f)
    print("\n".join(requirements(doc, a.torch, [e for e in a.extras.split(",") if e])))


if __name__ == "__main__":
    main()
