#!/usr/bin/env bash
# GPU figures for the learner step, the weight broadcast and the fast engine's
# GPU tests. Run on the device machine from the repo root: bash tools/gpu/figures.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
redis-server --port 6390 --save "" --appendonly no --daemonize yes >/dev/null
R=redis://127.0.0.1:6390/0
timeout 150 python3 -m streamrl.bench.learner_step --impl grouped_mm --out "$OUT/step_gmm.json" 2>&1 | tail -4
timeout 120 python3 -m streamrl.bench.learner_step --impl hf_grouped_mm --out "$OUT/step_hf.json" 2>&1 | tail -4
timeout 150 python3 -m streamrl.bench.cli weights --redis-url $R --device cuda --sizes 100,1000,2000 \
  --subscribers 1,2 --max-mem-gb 60 --json 2>&1 | tee "$OUT/weights_cuda.log" | tail -12
timeout 120 python3 -m streamrl.bench.cli weights --redis-url $R --sizes 100,1000,2000 --subscribers 1,4 \
  --max-mem-gb 60 --json 2>&1 | tee "$OUT/weights_cpu.log" | tail -12
timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu tests/test_hf_fast.py 2>&1 | tail -8
