#!/usr/bin/env bash
# Real-model RL on the GPU: SmolLM2-135M-Instruct GGUF -> HF -> 4-expert MoE, then
# accuracy on held-out arithmetic before and after a short colocated run (configs/smol-moe-gpu.yaml).
set -uo pipefail
source tools/gpu/env.sh || exit 1
cat /tmp/smol/part00 .smolB/part > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
python3 -m streamrl.models.prepare --gguf /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smol-moe \
  --experts 4 --top-k 2 2>&1 | tail -3
C=configs/smol-moe-gpu.yaml
python3 -m streamrl.evaluate --config $C --json 2>/dev/null | tail -1 | tee "$OUT/eval_before.json"
timeout ${TRAIN_TIMEOUT:-300} python3 -m streamrl.launcher.launch --config $C --learners 1 --rollers 1 \
  --steps ${STEPS:-40} --run-dir /tmp/smolrun 2>&1 | tail -8
cp /tmp/smolrun/summary.json "$OUT/summary.json"; cp /tmp/smolrun/metrics.jsonl "$OUT/metrics.jsonl"
tail -20 /tmp/smolrun/logs/learner.log > "$OUT/learner.log"; tail -20 /tmp/smolrun/logs/rollout-0.log > "$OUT/rollout.log"
python3 -m streamrl.evaluate --config $C --checkpoint latest run.run_dir=/tmp/smolrun --json 2>/dev/null | tail -1 \
  | tee "$OUT/eval_after.json"
