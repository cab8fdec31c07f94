#!/usr/bin/env bash
# GPU figures of multi-turn episodes: KV reuse across turns and tool/generation overlap
# on SmolLM2-135M (hf_fast, CUDA graphs). Run on the device machine from the repo root with .whl
# and models/smol carried; writes JSON lines under $OUT.
set -uo pipefail
source tools/gpu/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for kv in static paged; do
  python3 tools/bench_multiturn.py --model models/smol --device cuda --kv $kv --episodes 64 --turns 6 \
    --turn-tokens 64 --reply-chars 200 --tool-s 0.5 --iters 3 2>&1 | tee -a "$OUT/multiturn.jsonl" | tail -1
done
python3 -m pytest -q -p no:cacheprovider tests/test_hf_fast_sessions.py tests/test_envs_multiturn_kv.py 2>&1 \
  | tee "$OUT/pytest_multiturn.log" | tail -3
