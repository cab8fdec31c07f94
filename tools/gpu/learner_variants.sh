#!/usr/bin/env bash
# The real learner on the GPU recipe (configs/gpu-moe.yaml, learner + 1 worker on cuda:0) with
# learner variants side by side: eager vs learner.compile=true, and the V-trace critic.
# Prints per-variant median learner/compute_s over steps 6.. and reward first/last.
# Run on the device machine from the repo root: bash tools/gpu/learner_variants.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
STEPS=${STEPS:-20}
run() {  # name, overrides...
  local name=$1; shift
  timeout ${RUN_TIMEOUT:-170} python3 -m streamrl.launcher.launch --config configs/gpu-moe.yaml --learners 1 \
    --rollers 1 --steps "$STEPS" --run-dir /tmp/lv/$name "$@" > /tmp/lv-$name.log 2>&1
  echo "$name rc=$?"
  python3 - "$name" <<'PY'
import json, statistics, sys
name = sys.argv[1]
rows = [json.loads(l) for l in open(f"/tmp/lv/{name}/metrics.jsonl")]
c = [r["learner/compute_s"] for r in rows[5:] if "learner/compute_s" in r]
s = json.load(open(f"/tmp/lv/{name}/summary.json"))
print(json.dumps({"variant": name, "steps": len(rows), "median_compute_s_after_5": statistics.median(c) if c else None,
                  "first_compute_s": rows[0].get("learner/compute_s"), "reward_first": s.get("reward_first"),
                  "reward_last": s.get("reward_last"), "samples_per_s": s.get("samples_per_s"),
                  "explained_variance_last": rows[-1].get("learner/explained_variance")}))
PY
  cp /tmp/lv/$name/metrics.jsonl "$OUT/$name-metrics.jsonl" 2>/dev/null
  tail -5 /tmp/lv-$name.log
}
run eager "$@"
run compiled learner.compile=true "$@"
run vtrace learner.loss=vtrace "$@"
