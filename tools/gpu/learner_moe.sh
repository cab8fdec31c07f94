#!/usr/bin/env bash
# The MoE learner step on one H200 in ONE device call (<= 9 min): where the compiled step stands.
#   streamrl-bench learner --synthetic-moe (1.31 B Qwen3-MoE shape, bf16, Trainer.step on TOKENS
#   tokens per step packed into micro-batches of BUDGET (default one of 32k), FlexAttention block
#   masks, experts grouped_mm,
#   the LM head's log-probs in chunks of CHUNK rows, compiled with learner.compile), these runs in
#   this order (the model is built once into /tmp/moe131 by the first):
#     c4k     4 k tokens per sequence (8 x 4k), learner.compile, then --profile 2: kernel table in
#             $OUT/profile-c4k.txt, kernel families (ms) in the JSON
#     c1k     1 k (32 x 1k), learner.compile
#     c16k    16 k (2 x 16k), learner.compile
#     c32kac  32 k (1 x 32k), learner.compile + activation checkpointing (fits one H200?)
#   and on request (RUNS=...):
#     c4k128  4 k compiled, 128k tokens per step (32 x 4k: four 32k micro-batches, ONE optimizer
#             step; real RL steps are 64-512 sequences): the per-step costs (fused AdamW, metric
#             reads, the first micro-batch's host work) amortised over four micro-batches, the
#             later micro-batches built on the host while the device runs the one before
#     c4k128p c4k128 with --profile 1 ($OUT/profile-c4k128p.txt)
#     e4k     4 k eager (what compile buys)
#     c4k512  4 k compiled with the config's 512-row log-prob chunks (what CHUNK buys)
#     c4kone  4 k compiled, all 32k log-prob rows in one chunk: its bf16 logits (2 GiB) are kept
#             for the backward instead of recomputed (one LM-head matmul less)
#     f4k-fwd128x64 | f4k-fwd64x128 | f4k-bwd64 | f4k-bwd32x128 | f4k-safe
#             4 k compiled with FlexAttention kernel_options (torch's H200 defaults for head_dim 64,
#             bf16: fwd 128x128, 3 stages, 4 warps; bwd 64/128/128/64, 3 stages, 8 warps):
#               fwd128x64  fwd_BLOCK_M=128,fwd_BLOCK_N=64
#               fwd64x128  fwd_BLOCK_M=64,fwd_BLOCK_N=128
#               bwd64      bwd_BLOCK_M1=64,bwd_BLOCK_N1=64,bwd_BLOCK_M2=64,bwd_BLOCK_N2=64,bwd_num_warps=4
#               bwd32x128  bwd_BLOCK_M1=32,bwd_BLOCK_N1=128,bwd_BLOCK_M2=128,bwd_BLOCK_N2=32,bwd_num_warps=4
#               safe       ROWS_GUARANTEED_SAFE=true (every packed query sees at least itself)
# GPU_TESTS=0 skips the packing GPU tests run first (tests/test_packing_gpu.py, ~20 s).
# Output: one JSON line per run on stdout and in $OUT/learner_moe.jsonl, each run's full bench JSON
# in $OUT/lm-<run>.json, full logs in $OUT/lm-<run>.log.
# Env: RUNS (default "c4k c1k c16k c32kac"), STEPS (3), TOKENS (32768 tokens per step, a multiple
#      of each run's sequence length; c4k128* use 131072), BUDGET (32768 tokens per micro-batch),
#      CHUNK (4096 log-prob rows per LM-head chunk), ATTN (flex), TOTAL_S (530: the whole script's
#      budget; each run gets what is left, at most RUN_S=200 seconds).
# Run on the device machine from the repo root: bash tools/gpu/learner_moe.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
MODEL=/tmp/moe131
START=$(date +%s)  # TOTAL_S counts the tests too
# First the packing GPU tests (micro-batches moved through one pinned staging buffer per dtype)
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_packing_gpu.py 2>&1 | tail -3 | tee "$OUT/pytest_packing_gpu.log"
fi
STEPS=${STEPS:-3}
BUDGET=${BUDGET:-32768}
for RUN in ${RUNS:-c4k c1k c16k c32kac}; do
  COMPILED="--compile --logprob-chunk ${CHUNK:-4096}"
  TOK=${TOKENS:-32768}
  case $RUN in
    c4k)    L=4096;  EXTRA="$COMPILED --profile 2 --profile-out $OUT/profile-c4k.txt" ;;
    c1k)    L=1024;  EXTRA="$COMPILED" ;;
    c16k)   L=16384; EXTRA="$COMPILED" ;;
    c32kac) L=32768; EXTRA="$COMPILED --activation-checkpointing" ;;
    c4k128) L=4096;  TOK=131072; EXTRA="$COMPILED" ;;
    c4k128p) L=4096; TOK=131072; EXTRA="$COMPILED --profile 1 --profile-out $OUT/profile-c4k128p.txt" ;;
    e4k)    L=4096;  EXTRA="--logprob-chunk ${CHUNK:-4096}" ;;
    c4k512) L=4096;  EXTRA="--compile" ;;
    c4kone) L=4096;  EXTRA="--compile --logprob-chunk 32768" ;;
    f4k-fwd128x64) L=4096; EXTRA="$COMPILED --flex-options fwd_BLOCK_M=128,fwd_BLOCK_N=64" ;;
    f4k-fwd64x128) L=4096; EXTRA="$COMPILED --flex-options fwd_BLOCK_M=64,fwd_BLOCK_N=128" ;;
    f4k-bwd64)     L=4096; EXTRA="$COMPILED --flex-options bwd_BLOCK_M1=64,bwd_BLOCK_N1=64,bwd_BLOCK_M2=64,bwd_BLOCK_N2=64,bwd_num_warps=4" ;;
    f4k-bwd32x128) L=4096; EXTRA="$COMPILED --flex-options bwd_BLOCK_M1=32,bwd_BLOCK_N1=128,bwd_BLOCK_M2=128,bwd_BLOCK_N2=32,bwd_num_warps=4" ;;
    f4k-safe)      L=4096; EXTRA="$COMPILED --flex-options ROWS_GUARANTEED_SAFE=true" ;;
    *) echo "unknown run $RUN" >&2; continue ;;
  esac
  LEFT=$(( ${TOTAL_S:-530} - ($(date +%s) - START) ))
  LIMIT=$(( LEFT < ${RUN_S:-200} ? LEFT : ${RUN_S:-200} ))
  if [ "$LIMIT" -lt 30 ]; then echo "{\"run\": \"$RUN\", \"error\": \"skipped: TOTAL_S spent\"}" | tee -a "$OUT/learner_moe.jsonl"; continue; fi
  if [ $((TOK % L)) -ne 0 ] || [ "$TOK" -lt "$L" ]; then
    echo "{\"run\": \"$RUN\", \"error\": \"TOKENS=$TOK is not a multiple of the sequence length $L\"}" | tee -a "$OUT/learner_moe.jsonl"; continue
  fi
  T0=$(date +%s)
  timeout "$LIMIT" python3 -m streamrl.bench.learner --synthetic-moe --model $MODEL --device cuda \
    --dtype bfloat16 --impl packed --groups $((TOK / L)) --group-size 1 --prompt-len 64 \
    --response-len $((L - 64)) --budget "$BUDGET" --attention "${ATTN:-flex}" --steps "$STEPS" --threads 8 \
    $EXTRA --json > "$OUT/lm-$RUN.log" 2>&1
  RC=$?
  python3 - "$RUN" "$L" "$TOK" "$RC" "$(( $(date +%s) - T0 ))" "$OUT/lm-$RUN.log" "$OUT/lm-$RUN.json" <<'PY' | tee -a "$OUT/learner_moe.jsonl"
import json, sys
run, L, tok, rc, wall, log, full = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                    int(sys.argv[5]), sys.argv[6], sys.argv[7])
text = open(log).read()
lines = [l for l in text.splitlines() if l.startswith("{")]
try:
    res = json.loads(lines[-1]) if lines else {}
except ValueError:
    res = {}
if res:
    open(full, "w").write(json.dumps(res, indent=1))
res = res.get("packed", res)
keep = ("step_s", "tokens_per_s", "tflops", "mfu_vs_peak", "peak_cuda_GiB", "attention", "flex_options",
        "logprob_chunk_tokens", "microbatches_per_step", "prepare_s", "first_kernel_s")
out = {"run": run, "seq": L, "tokens_per_step": tok, "rc": rc, "wall_s": wall, **{k: res[k] for k in keep if k in res}}
prof = res.get("profile") or {}
if prof:
    out["profile"] = {k: prof.get(k) for k in ("device_ms_per_step", "families_ms", "top_kernels_ms",
                                                    "top_other_kernels_ms")}
if rc != 0 or not res:
    out["error"] = text[-800:]
print(json.dumps(out))
PY
done
