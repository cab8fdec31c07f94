#!/usr/bin/env bash
# Scaling figures on a multi-GPU kind (nvidia-h200-x2/x4/x8): run on the device machine from
# the repo root with .whl and .redis carried:   bash tools/gpu/scale.sh        (< 10 min on 8 GPUs)
#  1. learner tokens/s on 1, 2, 4, 8 GPUs (up to the count present), FSDP2 data parallel only vs dp x ep
#     (ep = the GPU count), for a model where expert parallel is needed: 64 experts, top-8, 8 layers of
#     hidden 2048 (3.3 B parameters, 3.2 B of them experts; 53 GB of bf16 weights + fp32 AdamW state
#     on one GPU). Scaling efficiency = tokens/s per GPU at n / tokens/s on one GPU.
#  2. raw NCCL broadcast bandwidth of 1 GiB between two GPUs (the reference for the weights plane).
#  3. the e2e loop with learners and rollout workers on disjoint GPUs (first half / second half),
#     weights over the NCCL plane; weights publish seconds per GB from its metrics.
# One JSON line per row on stdout and in $OUT/scale.jsonl. SKIP_LEARNER=1 / SKIP_E2E=1 leave parts out.
set -uo pipefail
source tools/gpu/env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
JSONL="$OUT/scale.jsonl"; : > "$JSONL"
echo "GPUs: $N"
MODEL=(--layers 8 --hidden 2048 --heads 16 --kv-heads 4 --head-dim 128 --experts 64 --topk 8 --moe-inter 1024
       --batch 8 --seq 2048 --steps 6 --warmup 2 --impl grouped_mm --compile)

learner() {  # name n ep
  local name=$1 n=$2 ep=$3
  local cmd=(python3 -m streamrl.bench.learner_step "${MODEL[@]}" --ep "$ep" --out "$OUT/$name.json")
  (( n > 1 )) && cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m streamrl.bench.learner_step
                     "${MODEL[@]}" --ep "$ep" --out "$OUT/$name.json")
  timeout 240 "${cmd[@]}" > "$OUT/$name.log" 2>&1
  python3 - "$OUT/$name.json" "$name" "$n" <<'PY' | tee -a "$JSONL"
import json, sys
path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    d = json.load(open(path))
except (OSError, ValueError):
    print(json.dumps({"run": name, "gpus": n, "error": f"no result; see {name}.log"})); sys.exit()
print(json.dumps({"run": name, "gpus": n, **{k: d.get(k) for k in ("ep", "step_s", "tokens_per_s_per_gpu",
      "tokens_per_s_total", "tflops_per_gpu", "mfu_vs_peak", "peak_mem_GiB")}}))
PY
}

if [[ -z ${SKIP_LEARNER:-} ]]; then
  for n in 1 2 4 8; do
    (( n > N )) && break
    learner "learner-dp$n" "$n" 1
    (( n > 1 )) && learner "learner-dp$n-ep$n" "$n" "$n"
  done
  python3 - "$JSONL" <<'PY' | tee -a "$JSONL"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"learner-' in l and "error" not in l]
one = next((r["tokens_per_s_per_gpu"] for r in rows if r["gpus"] == 1), None)
if one:
    print(json.dumps({"scaling_efficiency": {r["run"]: round(r["tokens_per_s_per_gpu"] / one, 3) for r in rows}}))
PY
fi

if (( N >= 2 )); then  # raw NCCL broadcast, rank 0 -> rank 1, 1 GiB, best of 5
  cat > /tmp/bcast.py <<'PY'
import json, os, time, torch, torch.distributed as dist
dist.init_process_group("nccl"); r = dist.get_rank(); torch.cuda.set_device(r)
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
best = float("inf")
for _ in range(6):
    torch.cuda.synchronize(); dist.barrier(); t = time.perf_counter()
    dist.broadcast(x, 0); torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t)
if r == 0:
    print(json.dumps({"run": "nccl-broadcast-1GiB", "GB_per_s": round((1 << 30) / best / 1e9, 1)}))
dist.destroy_process_group()
PY
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 /tmp/bcast.py 2> "$OUT/bcast.log" \
    | tee -a "$JSONL"
fi

if [[ -z ${SKIP_E2E:-} ]] && (( N >= 2 )); then  # learners on the first half, rollout workers on the second
  H=$(( N / 2 ))
  L=$(python3 -c "print('[' + ','.join(f'cuda:{i}' for i in range($H)) + ']')")
  R=$(python3 -c "print('[' + ','.join(f'cuda:{i}' for i in range($H, $N)) + ']')")
  rm -rf /tmp/scale-e2e
  timeout 300 python3 -m streamrl.launcher.launch --config configs/gpu-moe.yaml --learners "$H" --rollers "$H" \
    --steps 20 --run-dir /tmp/scale-e2e "placement.learner=$L" "placement.rollout=$R" "placement.colocate=[]" \
    weights.data_plane=nccl "weights.collective_world=$(( H + 1 ))" > "$OUT/e2e.log" 2>&1
  echo "e2e exit $?"; tail -4 "$OUT/e2e.log"
  cp /tmp/scale-e2e/metrics.jsonl "$OUT/e2e-metrics.jsonl" 2>/dev/null
  python3 - <<PY | tee -a "$JSONL"
import json, statistics
try:
    recs = [json.loads(l) for l in open("/tmp/scale-e2e/metrics.jsonl") if '"learner/step"' in l][4:]
except OSError:
    print(json.dumps({"run": "e2e-disjoint", "error": "no metrics; see e2e.log"})); raise SystemExit
pub = [r["weights/publish_s"] / (r["weights/bytes"] / 1e9) for r in recs if r.get("weights/publish_s")]
wall = recs[-1]["wall_s"] - recs[0]["wall_s"]
print(json.dumps({"run": "e2e-disjoint", "gpus": $N, "learner_gpus": "$L", "rollout_gpus": "$R",
                  "samples_per_s": (recs[-1]["learner/samples"] - recs[0]["learner/samples"]) / wall,
                  "learner_idle_pct": 100 * statistics.mean(r["learner/idle_frac"] for r in recs),
                  "publish_s_per_GB": statistics.median(pub) if pub else None}))
PY
fi
