#!/usr/bin/env bash
# Async vs sync on the GPU (issue 9): learner and one rollout worker as separate processes on
# cuda:0 (configs/gpu-moe.yaml). Run on the device machine from the repo root.
set -uo pipefail
source tools/gpu/env.sh || exit 1
STEPS=${STEPS:-30}
timeout ${E2E_TIMEOUT:-540} python3 -m streamrl.bench.cli e2e --config configs/gpu-moe.yaml --learners 1 --rollers 1 \
  --steps "$STEPS" --out /tmp/e2e --json "$@" 2>&1 | tail -20
for f in result.json async_vs_sync.png; do cp /tmp/e2e/$f "$OUT/" 2>/dev/null; done
for r in sync async; do
  cp /tmp/e2e/$r/metrics.jsonl "$OUT/$r-metrics.jsonl" 2>/dev/null
  tail -30 /tmp/e2e/$r/logs/learner.log > "$OUT/$r-learner.log" 2>/dev/null
done
tail -5 /tmp/e2e/async/logs/rollout-0.log 2>/dev/null
