#!/usr/bin/env bash
# The packed learner step at long sequences on one H200, next to plain transformers.
#   streamrl: streamrl-bench learner --synthetic-moe (Trainer.step: every step ONE packed
#             micro-batch of 32k tokens -- 32 x 1k, 8 x 4k, 2 x 16k or 1 x 32k sequences --
#             FlexAttention block masks (learner.attention = flex: tiles across sequences are
#             skipped), chunked response-only log-probs, experts grouped_mm), bf16, activation
#             checkpointing from 16k tokens on;
#   hf:       (HF=1) streamrl.bench.learner_step --impl hf_grouped_mm (transformers' own MoE block
#             with grouped_mm, full-vocab log-softmax, padded batch), same 1.31 B Qwen3-MoE shape.
# 32k tokens per step at every length; 64-token prompts. One JSON line per length.
# Env: LENS (default "1024 4096 16384 32768"), STEPS (3), BUDGET (32768), ATTN (flex), AC_FROM (16384:
#      activation checkpointing from this sequence length on),
#      HF (0: skip the transformers baseline, measured already), PROFILE (0: or N profiled steps
#      at each length; the top-25 kernel table lands in $OUT/profile-L.txt).
# Budget: < 8 min without HF (model built once ~1 min; each length compiles flex ~1 min).
# Run on the device machine from the repo root: bash tools/gpu/learner_long.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
MODEL=/tmp/moe131
STEPS=${STEPS:-3}
BUDGET=${BUDGET:-32768}
OUT=${OUT:-/tmp}
for L in ${LENS:-1024 4096 16384 32768}; do
  B=$((32768 / L))
  AC=""; [ "$L" -ge "${AC_FROM:-16384}" ] && AC=--activation-checkpointing
  PROF=""; [ "${PROFILE:-0}" -gt 0 ] && PROF="--profile $PROFILE --profile-out $OUT/profile-$L.txt"
  timeout ${RUN_TIMEOUT:-240} python3 -m streamrl.bench.learner --synthetic-moe --model $MODEL --device cuda \
    --dtype bfloat16 --impl packed --groups $B --group-size 1 --prompt-len 64 --response-len $((L - 64)) \
    --budget "$BUDGET" --attention "${ATTN:-flex}" --steps "$STEPS" --threads 8 $AC $PROF --json \
    > /tmp/ll-ours-$L.log 2>&1
  echo "ours L=$L rc=$?" >&2
  if [ "${HF:-0}" = 1 ]; then
    timeout ${RUN_TIMEOUT:-240} python3 -m streamrl.bench.learner_step --impl hf_grouped_mm --batch $B --seq $L \
      --steps "$STEPS" --warmup 1 --out /tmp/ll-hf-$L.json > /tmp/ll-hf-$L.log 2>&1
    echo "hf L=$L rc=$?" >&2
  fi
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
    hf = {"error": "not run (HF=1 runs it)"}
keep = lambda d, ks: {k: d[k] for k in ks if k in d} or d
prof = ours.get("profile", {})
print(json.dumps({"seq": int(L), "batch": int(B),
                  "streamrl": keep(ours, ("step_s", "tokens_per_s", "tflops", "mfu_vs_peak", "peak_cuda_GiB",
                                          "attention", "microbatches_per_step", "error")),
                  "profile_families_ms": prof.get("families_ms"),
                  "hf_grouped_mm": keep(hf, ("step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu_vs_peak",
                                             "peak_mem_GiB", "error"))}))
PY
  cp /tmp/ll-*-$L.* "$OUT/" 2>/dev/null
done
