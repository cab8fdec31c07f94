"""Learner start, full vs sharded: per-rank peak memory and start time on N gloo ranks (CPU).

    python tools/bench_sharded_start.py models/smol-moe --ranks 2 --ep 2

For each ``model.load`` (full, sharded) it spawns ``--ranks`` processes that build the learner's
model exactly as ``Trainer.__init__`` does (``load_model_and_tokenizer(defer_weights=True)`` +
``parallelize``) and prints one JSON line per mode: per-rank start seconds, peak RSS (GB, the
process's ``VmHWM``) and its growth over the process's peak before loading, next to the
size of the model's safetensors and the bytes of parameters the rank holds after sharding.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _peak_rss() -> int:
    """Peak resident bytes of this process image (VmHWM; ``ru_maxrss`` would also count the
    parent's peak from before the spawn's exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _start(rank: int, world: int, folder: str, load: str, ep: int) -> dict:
    import torch

    from streamrl.config import ModelConfig
    from streamrl.models.factory import load_model_and_tokenizer
    from streamrl.parallel.expert_parallel import parallelize
    from streamrl.parallel.mesh import build_mesh

    before = _peak_rss()
    t0 = time.perf_counter()
    model, _ = load_model_and_tokenizer(ModelConfig(path=folder, load=load), defer_weights=True)
    cfg = model.config
    experts = next((int(getattr(cfg, a)) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(cfg, a, None)), 0)
    parallelize(model, build_mesh(ep, "cpu", experts), torch.device("cpu"))
    secs = time.perf_counter() - t0
    peak = _peak_rss()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in model.parameters())
    return {"start_s": round(secs, 2), "peak_rss_gb": round(peak / 1e9, 3),
            "peak_growth_gb": round((peak - before) / 1e9, 3), "local_params_gb": round(local / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="HF model folder")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--modes", default="full,sharded", help="comma list of model.load values")
    args = ap.parse_args()

    from streamrl.parallel.testing import spawn_gloo

    size = sum(f.stat().st_size for f in Path(args.folder).glob("*.safetensors"))
    for load in args.modes.split(","):
        ranks = spawn_gloo(_start, args.ranks, str(Path(args.folder).resolve()), load, args.ep, timeout_s=1800)
        print(json.dumps({"model": args.folder, "safetensors_gb": round(size / 1e9, 3), "load": load,
                          "ranks": args.ranks, "ep": args.ep, "per_rank": ranks}), flush=True)


if __name__ == "__main__":
    main()
