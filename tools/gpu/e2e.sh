#!/usr/bin/env bash
# Async vs sync on the GPU: learner and one hf_fast rollout worker as separate
# processes on cuda:0, configs/gpu-long.yaml (responses of up to 1,024 tokens), REPEATS (3) runs
# of each alternately; medians and min-max spreads in result.json. Run on the device machine from
# the repo root. STEPS defaults to 8 (the config says 10) so 6 launches fit < 9 min: the first
# launch compiles the decode step, later ones reuse the inductor cache (TORCHINDUCTOR_CACHE_DIR).
# CONFIG=configs/gpu-moe.yaml STEPS=30 REPEATS=1 gives the README's MoE-recipe figure. ROLLERS (1): rollout
# workers, all on cuda:0; TAG names the $OUT subfolder; extra arguments are config overrides.
# The README's figures: one 60-step pair per call (~430 s cold, ~350 s warm), three
# calls back to back so the machine stays warm, then, here:
#   TAG=e1 STEPS=60 REPEATS=1 E2E_TIMEOUT=560 bash tools/gpu/e2e.sh      (then TAG=e2, TAG=e3)
#   streamrl-bench e2e --merge e1/result.json e2/result.json e3/result.json --out runs/e2e-merged
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
CONFIG=${CONFIG:-configs/gpu-long.yaml}
if [[ $CONFIG == configs/gpu-long.yaml && ! -f /tmp/moe-long/config.json ]]; then
  python3 tools/gpu/moe_long.py /tmp/moe-long > "$OUT/moe_long.log" 2>&1 || { echo "moe_long.py failed"; exit 1; }
fi
STEPS=${STEPS:-8}
REPEATS=${REPEATS:-3}
ROLLERS=${ROLLERS:-1}
TAG=${TAG:-e2e}          # several calls in one device command: outputs go to $OUT/$TAG
E2E=/tmp/$TAG; mkdir -p "$OUT/$TAG"
timeout ${E2E_TIMEOUT:-530} python3 -m streamrl.bench.cli e2e --config "$CONFIG" --learners 1 --rollers "$ROLLERS" \
  --steps "$STEPS" --repeats "$REPEATS" --out "$E2E" --json "$@" 2>&1 | tail -20
for f in result.json async_vs_sync.png; do cp "$E2E/$f" "$OUT/$TAG/" 2>/dev/null; done
for d in "$E2E"/sync* "$E2E"/async*; do
  [ -d "$d" ] || continue   # async_vs_sync.png matches async*
  r=$(basename "$d")
  cp "$d/metrics.jsonl" "$OUT/$TAG/$r-metrics.jsonl" 2>/dev/null
  { grep -m1 -B5 -A60 "^Traceback" "$d/logs/learner.log"; echo ...; tail -30 "$d/logs/learner.log"; } \
    > "$OUT/$TAG/$r-learner.log" 2>/dev/null
  for w in "$d"/logs/rollout*.log; do [ -f "$w" ] || continue; tail -15 "$w" > "$OUT/$TAG/$r-$(basename "$w")" 2>/dev/null; done
done
# The device returns at most 8 files: keep result.json and the figure, bundle the per-run files.
(cd "$OUT/$TAG" && tar czf "/tmp/$TAG-runs.tgz" --exclude=result.json --exclude=async_vs_sync.png . \
  && find . -type f ! -name result.json ! -name async_vs_sync.png -delete && mv "/tmp/$TAG-runs.tgz" runs.tgz)
E2E=$E2E python3 - <<'PY' 2>/dev/null
import json, os; r = json.load(open(os.environ["E2E"] + "/result.json"))
for run in r["runs"]:
    print("launch wall s (sync, async):", [round(x) for x in run["launch_wall_s"]], "speedup", round(run["speedup_async_vs_sync"], 3),
          "steady", round(run["speedup_async_vs_sync_steady"], 3))
PY
