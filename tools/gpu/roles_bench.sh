#!/usr/bin/env bash
# Per-role cost on the GPU (issue 20): the reference and critic colocated in the learner vs
# served by their own processes, on the GPU recipe's model (configs/gpu-moe.yaml), one H200.
# Prints tools/bench_roles.py's JSON (median ms per learner step / per role-server batch, and
# bytes each role holds) for a 8 x 16 batch of 128-token prompts and 512-token responses.
# Run on the device machine from the repo root: bash tools/gpu/roles_bench.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
python3 tools/bench_roles.py --config configs/gpu-moe.yaml --device cuda:0 --iters 5 --groups 8 --group-size 16 \
  --prompt-len 128 --response-len 512 learner.device=cuda | tee "$OUT/roles_bench.json"
