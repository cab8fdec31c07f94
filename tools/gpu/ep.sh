#!/usr/bin/env bash
# Multi-GPU learner-step figures: expert parallel over the GPUs vs FSDP2 data parallel
# only, same model and per-GPU batch, plus the 2-GPU NCCL weights plane test. Needs >= 2 GPUs
# (device kind nvidia-h200-x2). Run on the device machine from the repo root: bash tools/gpu/ep.sh
set -uo pipefail
source tools/gpu/env.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
N=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $N"
step() {  # name, torchrun/python args...
  local name=$1; shift
  timeout 150 "$@" --impl grouped_mm --steps 8 --out "$OUT/$name.json" > "/tmp/$name.log" 2>&1
  python3 - "$OUT/$name.json" "$name" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print(sys.argv[2], "failed"); sys.exit()
print(json.dumps({"run": sys.argv[2], **{k: d[k] for k in ("world", "ep", "step_s", "tokens_per_s_per_gpu",
      "tokens_per_s_total", "tflops_per_gpu", "mfu_vs_peak", "peak_mem_GiB")}}))
PY
  tail -3 "/tmp/$name.log" | grep -i error
}
step one_gpu python3 -m streamrl.bench.learner_step
step dp${N}_ep1 python3 -m torch.distributed.run --standalone --nproc-per-node "$N" -m streamrl.bench.learner_step --ep 1
step dp${N}_ep${N} python3 -m torch.distributed.run --standalone --nproc-per-node "$N" -m streamrl.bench.learner_step --ep "$N"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weights.py -k nccl 2>&1 | tail -2
