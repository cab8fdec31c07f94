#!/usr/bin/env bash
# The MoE learner step on one H200 in ONE device call (< 8 min): where the compiled step stands.
#   streamrl-bench learner --synthetic-moe (1.31 B Qwen3-MoE shape, bf16, Trainer.step with one
#   packed micro-batch of 32k tokens per step, FlexAttention block masks, experts grouped_mm),
#   at these runs, in this order (cheapest first; the model is built once into /tmp/moe131):
#     c1k    1 k tokens per sequence (32 x 1k), learner.compile
#     c4k    4 k (8 x 4k), learner.compile, then --profile 2: kernel table in $OUT/profile-c4k.txt,
#            kernel families (ms) in the JSON
#     e4k    4 k eager (what compile buys)
#     c32kac 32 k (1 x 32k), learner.compile + activation checkpointing (fits one H200?)
# Output: one JSON line per run on stdout and in $OUT/learner_moe.jsonl; full logs $OUT/lm-*.log.
# Env: RUNS (default "c1k c4k e4k c32kac"), STEPS (3), BUDGET (32768 tokens per micro-batch),
#      ATTN (flex), TOTAL_S (450: the whole script's budget; each run gets what is left, at most
#      RUN_S=200 seconds).
# Run on the device machine from the repo root: bash tools/gpu/learner_moe.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
MODEL=/tmp/moe131
STEPS=${STEPS:-3}
BUDGET=${BUDGET:-32768}
START=$(date +%s)
for RUN in ${RUNS:-c1k c4k e4k c32kac}; do
  case $RUN in
    c1k)    L=1024;  EXTRA="--compile" ;;
    c4k)    L=4096;  EXTRA="--compile --profile 2 --profile-out $OUT/profile-c4k.txt" ;;
    e4k)    L=4096;  EXTRA="" ;;
    c32kac) L=32768; EXTRA="--compile --activation-checkpointing" ;;
    *) echo "unknown run $RUN" >&2; continue ;;
  esac
  LEFT=$(( ${TOTAL_S:-450} - ($(date +%s) - START) ))
  LIMIT=$(( LEFT < ${RUN_S:-200} ? LEFT : ${RUN_S:-200} ))
  if [ "$LIMIT" -lt 30 ]; then echo "{\"run\": \"$RUN\", \"error\": \"skipped: TOTAL_S spent\"}" | tee -a "$OUT/learner_moe.jsonl"; continue; fi
  T0=$(date +%s)
  timeout "$LIMIT" python3 -m streamrl.bench.learner --synthetic-moe --model $MODEL --device cuda \
    --dtype bfloat16 --impl packed --groups $((32768 / L)) --group-size 1 --prompt-len 64 \
    --response-len $((L - 64)) --budget "$BUDGET" --attention "${ATTN:-flex}" --steps "$STEPS" --threads 8 \
    $EXTRA --json > "$OUT/lm-$RUN.log" 2>&1
  RC=$?
  python3 - "$RUN" "$L" "$RC" "$(( $(date +%s) - T0 ))" "$OUT/lm-$RUN.log" <<'PY' | tee -a "$OUT/learner_moe.jsonl"
import json, sys
run, L, rc, wall, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
text = open(log).read()
lines = [l for l in text.splitlines() if l.startswith("{")]
try:
    res = json.loads(lines[-1]) if lines else {}
except ValueError:
    res = {}
res = res.get("packed", res)
keep = ("step_s", "tokens_per_s", "tflops", "mfu_vs_peak", "peak_cuda_GiB", "attention", "microbatches_per_step")
out = {"run": run, "seq": L, "rc": rc, "wall_s": wall, **{k: res[k] for k in keep if k in res}}
prof = res.get("profile") or {}
if prof:
    out["profile"] = {k: prof.get(k) for k in ("device_ms_per_step", "families_ms", "top_kernels_ms")}
if rc != 0 or not res:
    out["error"] = text[-800:]
print(json.dumps(out))
PY
done
