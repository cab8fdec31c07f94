#!/usr/bin/env bash
# Per-role cost on the GPU: the reference and critic colocated in the learner vs
# served by their own processes, on the GPU recipe's model (configs/gpu-moe.yaml), one H200.
# Prints tools/bench_roles.py's JSON (median ms per learner step / per role-server batch, and
# bytes each role holds) for a 8 x 16 batch of 128-token prompts and 512-token responses, in
# 32k-token micro-batches as configs/gpu-long.yaml (the CPU default of 2,048 tokens cut the 82k-token
# step into 40 and a run took over 150 s).
# Run on the device machine from the repo root: bash tools/gpu/roles_bench.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
python3 tools/bench_roles.py --config configs/gpu-moe.yaml --device cuda:0 --iters 5 --groups 8 --group-size 16 \
  --prompt-len 128 --response-len 512 learner.device=cuda model.max_positions=640 \
  learner.max_tokens_per_microbatch=32768 learner.logprob_chunk_tokens=4096 | tee "$OUT/roles_bench.json"
