#!/usr/bin/env bash
# Async vs sync on the GPU (issues 9, 18): learner and one hf_fast rollout worker as separate
# processes on cuda:0, configs/gpu-long.yaml (responses of up to 1,024 tokens), REPEATS (3) runs
# of each alternately; medians and min-max spreads in result.json. Run on the device machine from
# the repo root. STEPS defaults to 8 (the config says 10) so 6 launches fit < 9 min: the first
# launch compiles the decode step, later ones reuse the inductor cache (TORCHINDUCTOR_CACHE_DIR).
# CONFIG=configs/gpu-moe.yaml STEPS=30 REPEATS=1 gives the issue-9 figure.
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
CONFIG=${CONFIG:-configs/gpu-long.yaml}
STEPS=${STEPS:-8}
REPEATS=${REPEATS:-3}
timeout ${E2E_TIMEOUT:-530} python3 -m streamrl.bench.cli e2e --config "$CONFIG" --learners 1 --rollers 1 \
  --steps "$STEPS" --repeats "$REPEATS" --out /tmp/e2e --json "$@" 2>&1 | tail -20
for f in result.json async_vs_sync.png; do cp /tmp/e2e/$f "$OUT/" 2>/dev/null; done
for d in /tmp/e2e/sync* /tmp/e2e/async*; do
  r=$(basename "$d")
  cp "$d/metrics.jsonl" "$OUT/$r-metrics.jsonl" 2>/dev/null
  tail -30 "$d/logs/learner.log" > "$OUT/$r-learner.log" 2>/dev/null
done
python3 - <<'PY' 2>/dev/null
import json; r = json.load(open("/tmp/e2e/result.json"))
for run in r["runs"]:
    print("launch wall s (sync, async):", [round(x) for x in run["launch_wall_s"]], "speedup", round(run["speedup_async_vs_sync"], 3))
PY
