#!/usr/bin/env bash
# GPU figures of the fast transformers engine. Run on the device machine from the repo
# root with .whl carried (see ../shared/tools/device-wheels.sh); writes JSON/logs under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m streamrl.bench.hf_fast --preset moe-1b --device cuda --batch 256 --json 2>&1 | tee "$OUT/bench_b256.log" | tail -3
python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/test_hf_fast.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
python3 -m streamrl.bench.hf_fast --preset moe-1b --device cuda --batch 64 --json 2>&1 | tee "$OUT/bench_b64.log" | tail -3
