#!/usr/bin/env bash
# The packed learner step at long sequences on one H200, next to plain transformers.
#   streamrl: streamrl-bench learner --synthetic-moe (Trainer.step: packed micro-batches of one
#             sequence each, chunked response-only log-probs, experts grouped_mm), bf16,
#             activation checkpointing from 16k tokens on;
#   hf:       streamrl.bench.learner_step --impl hf_grouped_mm (transformers' own MoE block with
#             grouped_mm, full-vocab log-softmax), same 1.31 B Qwen3-MoE shape.
# 32k tokens per step at every length (32 x 1k, 8 x 4k, 2 x 16k, 1 x 32k); 64-token prompts.
# Prints one JSON line per sequence length. Budget: < 8 min (model built once, ~1 min).
# Run on the device machine from the repo root: bash tools/gpu/learner_long.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
MODEL=/tmp/moe131
STEPS=${STEPS:-3}
for L in ${LENS:-1024 4096 16384 32768}; do
  B=$((32768 / L))
  AC=""; [ "$L" -ge 16384 ] && AC=--activation-checkpointing
  timeout ${RUN_TIMEOUT:-200} python3 -m streamrl.bench.learner --synthetic-moe --model $MODEL --device cuda \
    --dtype bfloat16 --impl packed --groups $B --group-size 1 --prompt-len 64 --response-len $((L - 64)) \
    --budget $L --steps "$STEPS" --threads 8 $AC --json > /tmp/ll-ours-$L.log 2>&1
  echo "ours L=$L rc=$?" >&2
  timeout ${RUN_TIMEOUT:-200} python3 -m streamrl.bench.learner_step --impl hf_grouped_mm --batch $B --seq $L \
    --steps "$STEPS" --warmup 1 --out /tmp/ll-hf-$L.json > /tmp/ll-hf-$L.log 2>&1
  echo "hf L=$L rc=$?" >&2
  python3 - "$L" "$B" <<'PY'
import json, sys
L, B = sys.argv[1], sys.argv[2]
def last_json(path):
    try:
        lines = [l for l in open(path) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": open(path).read()[-600:]}
    except OSError as e:
        return {"error": str(e)}
ours = last_json(f"/tmp/ll-ours-{L}.log")
ours = ours.get("packed", ours)
try:
    hf = json.load(open(f"/tmp/ll-hf-{L}.json"))
except (OSError, ValueError):
    hf = {"error": open(f"/tmp/ll-hf-{L}.log").read()[-600:]}
keep = lambda d, ks: {k: d[k] for k in ks if k in d} or d
print(json.dumps({"seq": int(L), "batch": int(B),
                  "streamrl": keep(ours, ("step_s", "tokens_per_s", "tflops", "mfu_vs_peak", "peak_cuda_GiB", "error")),
                  "hf_grouped_mm": keep(hf, ("step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu_vs_peak",
                                             "peak_mem_GiB", "error"))}))
PY
  cp /tmp/ll-*-$L.* "$OUT/" 2>/dev/null
done
