#!/usr/bin/env bash
# Collects what the race needs on the GPU machine beyond ../shared/tools/device-wheels.sh, into two folders of the
# checkout that git ignores (tools/gpu/race.sh's header says which call carries which):
#   .whlrg:   reasoning-gym and math-verify with their dependencies, at the versions this checkout's .venv runs
#             (make setup), as py3.12 wheels; a dependency PyPI ships only as source is built into a wheel here when
#             it is pure Python, else carried as its sdist (pycosat: race.sh builds it on the device);
#   .whlpeer: TRL's GRPOTrainer and what it needs that the device lacks (the pins of pyproject's peer group).
# Left out: what the device image has (torch and its sympy/mpmath, transformers and its numpy/pyyaml/packaging).
# Run from the project root after make setup:  bash tools/gpu/race_wheels.sh
set -euo pipefail
PY=.venv/bin/python
for d in .whlrg .whlpeer; do grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
rm -rf .whlrg .whlpeer && mkdir -p .whlrg .whlpeer
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# name==version of reasoning-gym, math-verify and everything they require, as installed in .venv
pins=$($PY - <<'PY'
import importlib.metadata as md, re
from packaging.requirements import Requirement
ON_DEVICE = {"numpy", "sympy", "mpmath", "packaging", "pyyaml", "torch", "transformers"}
seen = {}
def walk(name):
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen or key in ON_DEVICE:
        return
    dist = md.distribution(name)
    seen[key] = dist.version
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            walk(req.name)
for top in ("reasoning-gym", "math-verify"):
    walk(top)
print(" ".join(f"{k}=={v}" for k, v in sorted(seen.items())))
PY
)
for p in $pins setuptools; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whlrg "$p" 2>/dev/null && continue
  if [[ $p == pycosat==* ]]; then  # a C extension: built on the device, where its Python headers are
    python3 -m pip download -q --no-deps --no-binary=:all: -d .whlrg "$p"
  else                             # pure Python sources: one wheel for any Python
    $PY -m pip wheel -q --no-deps -w .whlrg "$p"
  fi
done
for p in trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whlpeer "$p"
done
du -sh .whlrg .whlpeer
