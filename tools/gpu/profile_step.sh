#!/usr/bin/env bash
# One hf_fast decode step of the 1 B MoE at batch 256 on the H200: graph-replay time and
# a torch.profiler top-kernels table, static and paged KV cache (tools/gpu/hf_fast_profile.py).
# Run on the device machine from the repo root with .whl carried; < 5 min. Tables in $OUT.
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
for kv in static paged; do
  timeout 200 python3 tools/gpu/hf_fast_profile.py 256 "$kv" > "$OUT/profile_b256_$kv.txt" 2> "$OUT/profile_b256_$kv.err"
  echo "== $kv (rc $?)"; head -1 "$OUT/profile_b256_$kv.txt"; sed -n 2,22p "$OUT/profile_b256_$kv.txt" | cut -c1-160
done
