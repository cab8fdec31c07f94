"""Learner start, full vs sharded: per-rank peak memory and start time on N gloo ranks (CPU).

    python tools/bench_sharded_start.py models/smol-moe --ranks 2 --ep 2

For each ``model.load`` (full, sharded) it spawns ``--ranks`` processes that build the learner's
model exactly as ``Trainer.__init__`` does (``load_model_and_tokenizer(defer_weights=True)`` +
``parallelize``) and prints one JSON line per mode: per-rank start seconds, peak RSS (GB, the
process's ``VmHWM``) and its growth over the process's peak before loading, next to the
size of the model's safetensors and the bytes of parameters the rank holds after sharding.

On GPUs, under torchrun (one process per GPU, NCCL; adds ``cuda_peak_gb``, the rank's
``torch.cuda.max_memory_allocated``)::

    torchrun --standalone --nproc-per-node 2 tools/bench_sharded_start.py MODEL --ep 2 --device cuda --modes sharded
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _start(rank: int, world: int, folder: str, load: str, ep: int, device: str = "cpu") -> dict:
    import torch

    from streamrl.config import ModelConfig
    from streamrl.models.factory import load_model_and_tokenizer
    from streamrl.parallel.expert_parallel import parallelize
    from streamrl.parallel.mesh import build_mesh
    from streamrl.utils import peak_rss_bytes

    before = peak_rss_bytes()
    t0 = time.perf_counter()
    model, _ = load_model_and_tokenizer(ModelConfig(path=folder, load=load), defer_weights=True)
    cfg = model.config
    experts = next((int(getattr(cfg, a)) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(cfg, a, None)), 0)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    parallelize(model, build_mesh(ep, dev.type, experts), dev)
    secs = time.perf_counter() - t0
    peak = peak_rss_bytes()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in model.parameters())
    return {"start_s": round(secs, 2), "peak_rss_gb": round(peak / 1e9, 3),
            "peak_growth_gb": round((peak - before) / 1e9, 3), "local_params_gb": round(local / 1e9, 3),
            **({"cuda_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3)} if device == "cuda" else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="HF model folder")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--modes", default="full,sharded", help="comma list of model.load values")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: run under torchrun")
    args = ap.parse_args()
    folder = str(Path(args.folder).resolve())
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    head = {"model": args.folder, "safetensors_gb": round(size / 1e9, 3), "ep": args.ep, "device": args.device}
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch
        import torch.distributed as dist

        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        for load in args.modes.split(","):
            out = _start(dist.get_rank(), dist.get_world_size(), folder, load, args.ep, args.device)
            print(json.dumps({**head, "load": load, "rank": dist.get_rank(), **out}), flush=True)
            dist.barrier()
        dist.destroy_process_group()
        return
    from tests.dist_helpers import spawn_gloo

    for load in args.modes.split(","):
        ranks = spawn_gloo(_start, args.ranks, folder, load, args.ep, timeout_s=1800)
        print(json.dumps({**head, "load": load, "ranks": args.ranks, "per_rank": ranks}), flush=True)


if __name__ == "__main__":
    main()
