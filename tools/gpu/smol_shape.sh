#!/usr/bin/env bash
# The SmolLM2-135M recipe on one H200: a random SmolLM2-shaped folder (9 query / 3 KV
# heads, fp32, made by tools/gpu/smol_shape/make.py), 8 prompts x 8 samples, <= 24 new tokens,
# learner and one hf_fast worker colocated on cuda:0. Reports samples/s, learner idle % and the
# weight publish time as a share of a step (target: >= 195 samples/s, idle < 15 %, publish < 10 %).
# The random weights never earn a reward, so every GRPO advantage is 0: skip_no_signal is off, or the
# learner would skip its optimizer step and the figure would time a step that does nothing.
# Run on the device machine from the repo root (< 3 min a run). ENGINE=hf gives the issue's baseline.
# Knobs: PPB (prompts per rollout batch, 8), STALENESS (2), INTERVAL (learner.publish_interval, 1),
# ROLLERS (1), RUN (a name for the output files), and extra key=value overrides as arguments.
# The recipe in docs/benchmarks.md (three runs back to back, medians with spreads):
#   STEPS=100 TRAIN_TIMEOUT=150 PPB=32 STALENESS=8 INTERVAL=4 ROLLERS=2 RUN=F1 bash tools/gpu/smol_shape.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
[[ -f /tmp/smol/config.json ]] || python3 tools/gpu/smol_shape/make.py tools/gpu/smol_shape /tmp/smol || exit 1
cat > /tmp/smol-gpu.yaml <<YAML
run: {name: smol-gpu, seed: 0, steps: ${STEPS:-150}, run_dir: /tmp/smol-run}
model: {path: /tmp/smol, dtype: float32}
task: {name: arithmetic, num_digits: 2}
rollout:
  engine: ${ENGINE:-hf_fast}
  group_size: 8
  prompts_per_batch: ${PPB:-8}
  max_new_tokens: 24
  temperature: 1.0
  chat_template: true
  rewards: exact_answer=1.0,format=0.1
  max_model_len: 256
  device: cuda
learner: {lr: 1.0e-6, groups_per_step: 8, max_staleness: ${STALENESS:-2}, loss: grpo_tis, device: cuda,
          shared_prompt: true, skip_no_signal: false, publish_interval: ${INTERVAL:-1}}
placement: {learner: [cuda:0], rollout: [cuda:0], colocate: [[learner, rollout]]}
YAML
rm -rf /tmp/smol-run
timeout ${TRAIN_TIMEOUT:-300} python3 -m streamrl.launcher.launch --config /tmp/smol-gpu.yaml --learners 1 --rollers ${ROLLERS:-1} "$@" \
  2>&1 | tail -3
cp /tmp/smol-run/metrics.jsonl "$OUT/smol-${RUN:-run}-metrics.jsonl" 2>/dev/null
tail -20 /tmp/smol-run/logs/learner.log > "$OUT/smol-${RUN:-run}-learner.log" 2>/dev/null
tail -20 /tmp/smol-run/logs/rollout-0.log > "$OUT/smol-${RUN:-run}-rollout.log" 2>/dev/null
python3 - <<'PY'
import json, statistics
recs = [json.loads(l) for l in open("/tmp/smol-run/metrics.jsonl")]
recs = recs[len(recs) // 5:]  # the first fifth warms up (compile, graph capture)
wall = recs[-1]["wall_s"] - recs[0]["wall_s"]
samples = recs[-1]["learner/samples"] - recs[0]["learner/samples"]
idle = sum(r["learner/idle_s"] for r in recs[1:]); busy = sum(r["learner/step_s"] for r in recs[1:])
steps = [b["wall_s"] - a["wall_s"] for a, b in zip(recs, recs[1:])]
pub = [r["weights/publish_s"] for r in recs[1:] if r.get("weights/publish_s") is not None]
def med(key):  # the median of a per-step metric over the measured steps (None when never logged)
    vals = [r[key] for r in recs[1:] if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None
skipped = sum(r.get("learner/skipped_no_signal", 0) for r in recs)
out = {"samples_per_s": samples / wall, "learner_idle_pct": 100 * idle / (idle + busy),
       "step_s_median": statistics.median(steps), "publish_s_median": statistics.median(pub) if pub else None,
       "publish_share_of_wall": sum(pub) / wall, "learner_step_s_median": statistics.median(r["learner/step_s"] for r in recs),
       "learner_compute_s_median": med("learner/compute_s"), "publish_gather_s_median": med("weights/gather_s"),
       "publish_write_s_median": med("weights/write_s"),
       "staleness_mean": statistics.mean(r["learner/staleness_mean"] for r in recs),
       "steps_measured": len(recs) - 1, "steps_skipped": skipped}
import os; out["run"] = os.environ.get("RUN", "run"); print(json.dumps(out))
PY
