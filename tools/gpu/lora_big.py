"""LoRA RL on a model whose full fine-tuning does not fit one GPU: the learner's step and an adapter publish.

The model is a Qwen3-MoE of Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 query / 4 kv heads of 128,
128 experts of 768 with 8 active; random weights, bf16) built by the learner's own factory directly on the
GPU, with the run's character tokenizer (a ~100-token vocabulary: the 151k-token embedding and head of the
real model, 0.6 B of its 30.5 B parameters, are left out). Full fine-tuning needs parameters, gradients and
two AdamW moments: at least 8 bytes per parameter in pure bf16 (244 GB), against the H200's 139 GiB; LoRA
keeps the bf16 base frozen (61 GB) and trains the adapters alone.

What runs is StreamRL's own :class:`~streamrl.learner.trainer.Trainer` with ``model.lora`` on the attention
projections, activation checkpointing and packed micro-batches, on ``--groups`` trajectories of
``--prompt-len + --response-len`` random tokens (group size 1, every sample trained). Then the adapter version
is published through the real publisher (shm plane, real Redis) and loaded by a subscriber, next to a
full-weight publish of the same bytes-per-second path on ``--full-sample-gb`` of the base (a whole 61 GB
version would need that much page-locked host memory: its time is reported scaled from the sample, and
labelled so).

Reported (one JSON line): parameters (total, active, trainable), tokens/s, model TFLOP/s and % of
``--peak`` -- counted as what a frozen-base step must do: the forward and the input gradients (4 x active
matmul parameters per token plus causal attention), not the 6 x of full training, and without the
recomputation of activation checkpointing -- peak GPU memory, and per version kind bytes, publish seconds
and publish-to-loaded seconds.

    python3 tools/gpu/lora_big.py --json                                  # the H200 run
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 tools/gpu/lora_big.py --json --budget 4096   # an 80 GB H100
    python3 tools/gpu/lora_big.py --shape tiny --device cpu --json        # the CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from streamrl.bench.learner import make_batch
from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.trainer import Trainer
from streamrl.launcher.redis_server import RedisServer
from streamrl.weights.layout import tensor_count
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber

REPO = Path(__file__).resolve().parents[2]
# (layers, hidden, heads, kv heads, head dim, experts, active experts, expert size)
SHAPES = {"qwen3-30b-a3b": (48, 2048, 32, 4, 128, 128, 8, 768), "tiny": (2, 64, 2, 1, 32, 8, 2, 64)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--groups", type=int, default=4, help="trajectories per step (group size 1)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=4032)
    p.add_argument("--budget", type=int, default=16384, help="learner.max_tokens_per_microbatch")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one untimed step")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--attention", default="auto")
    p.add_argument("--full-sample-gb", type=float, default=4.0)
    p.add_argument("--peak", type=float, default=790.0, help="bf16 peak TFLOP/s of the device")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def make_config(args):
    layers, hidden, heads, kv, hd, experts, topk, inter = SHAPES[args.shape]
    return load_config(str(REPO / "configs" / "tiny.yaml"), [
        f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.num_heads={heads}",
        f"model.num_kv_heads={kv}", f"model.head_dim={hd}", f"model.num_experts={experts}",
        f"model.experts_per_token={topk}", f"model.expert_size={inter}",
        f"model.max_positions={args.prompt_len + args.response_len}",
        f"model.dtype={'bfloat16' if args.device.startswith('cuda') else 'float32'}",
        "model.lora.enabled=true", f"model.lora.r={args.r}", f"model.lora.alpha={2 * args.r}",
        f"model.lora.target_modules=[{args.targets}]",
        f"learner.device={args.device}", "learner.activation_checkpointing=true", f"learner.attention={args.attention}",
        f"learner.max_tokens_per_microbatch={args.budget}", f"rollout.max_new_tokens={args.response_len}",
        "rollout.temperature=1.0", "learner.lr=1e-5", "learner.aux_loss_coef=0",
        # groups of one carry no GRPO signal: every step must still train every sample
        "learner.skip_no_signal=false", "learner.drop_zero_advantage=false",
    ])


def build_trainer(args) -> Trainer:
    """The learner, its random base built straight on the device in the run's dtype (a 30 B model built on the
    host in float32 first would take 122 GB of host memory)."""
    cfg = make_config(args)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            return Trainer(cfg)
    finally:
        torch.set_default_dtype(old)


def model_flops_per_token(args, trainer) -> tuple[float, float]:
    """(active matmul parameters per token, frozen-base step FLOPs per token: forward + input gradients)."""
    layers, hidden, heads, kv, hd, experts, topk, inter = SHAPES[args.shape]
    attn = hidden * heads * hd * 2 + hidden * kv * hd * 2
    active = layers * (attn + topk * 3 * hidden * inter + hidden * experts) + hidden * trainer.vocab_size
    seq = args.prompt_len + args.response_len
    attention = 2 * 2 * layers * seq * heads * hd  # causal: half of QK^T and PV, forward; x2 for the backward
    return float(active), float(4 * active + attention)


def time_steps(args, tr: Trainer) -> dict:
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    batch = make_batch(tr.tokenizer, argparse.Namespace(groups=args.groups, group_size=1, prompt_len=args.prompt_len,
                                                        response_len=args.response_len))
    t0 = time.perf_counter()
    tr.step(batch)  # compiles and allocator growth
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tr.step(batch)
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    tokens = args.groups * (args.prompt_len + args.response_len)
    active, per_tok = model_flops_per_token(args, tr)
    tflops = per_tok * tokens / step_s / 1e12
    out = {"first_step_s": first, "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
           "active_params": active, "model_tflops": tflops, "pct_of_peak": 100 * tflops / args.peak}
    if args.device.startswith("cuda"):
        out["peak_gpu_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class _DeviceCopy:
    """The rollout side of the timing: every fetched tensor copied to the device (what an engine's load
    starts with; an adapter version's merge into the base is timed by ``streamrl-bench lora``)."""

    def __init__(self, device: str):
        self.device = device

    def load_weights(self, named) -> None:
        for _, t in named:
            t.to(self.device, non_blocking=False)


def publish_rows(tr: Trainer, device: str, sample_bytes: int) -> dict:
    """Best-of-2 publish and publish-to-loaded seconds of the adapter version and of a full-weight sample."""
    redis = RedisServer(Path(tempfile.mkdtemp(prefix="lora-big-redis-"))).start()
    try:
        run = f"lora-big-{uuid.uuid4().hex[:8]}"
        coord = Coordinator(redis.url, run)
        pub = WeightPublisher(coord, run, plane="shm", keep=2)
        sub = WeightSubscriber(coord, plane="shm")
        target, rows, version = _DeviceCopy(device), {}, 0
        try:
            for kind, specs, tensors in _versions(tr, sample_bytes):
                best: dict[str, float] = {}
                for i in range(3):  # the first round allocates the store's pages; best of the other two
                    t0 = time.perf_counter()
                    timings = pub.publish(version, specs, iter(tensors))
                    t1 = time.perf_counter()
                    assert sub.load(target, 0, version) == version
                    t2 = time.perf_counter()
                    if i:
                        row = {"publish_s": t1 - t0, "publish_to_loaded_s": t2 - t0}
                        best = {k: min(v, best.get(k, v)) for k, v in row.items()}
                    version += 1
                rows[kind] = {"bytes": int(timings["weights/bytes"]), "tensors": tensor_count(specs), **best}
        finally:
            sub.close()
            pub.close()
    finally:
        redis.stop()
    return rows


def _versions(tr: Trainer, sample_bytes: int):
    """(kind, specs, tensors): the adapter version, then the frozen base's parameters up to ``sample_bytes``."""
    yield "lora", tr.param_specs, list(tr.full_tensors())
    specs, sample, size = [], [], 0
    for name, p in tr.model.named_parameters():
        if p.requires_grad or size >= sample_bytes:
            continue
        t = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        specs.append((name, t.dtype, tuple(t.shape)))
        sample.append(t)
        size += t.numel() * t.element_size()
    yield "full_sample", specs, sample


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(0)
    t0 = time.perf_counter()
    tr = build_trainer(args)
    params = list(tr.model.parameters())
    base_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    res = {"shape": args.shape, "device": args.device, "r": args.r, "targets": args.targets,
           "total_params": sum(p.numel() for p in params),
           "trainable_params": sum(p.numel() for p in params if p.requires_grad),
           "build_s": time.perf_counter() - t0}
    res["full_ft_min_GB_bf16"] = 8 * res["total_params"] / 1e9  # bf16 params + grads + two AdamW moments
    print(json.dumps(res), flush=True)
    res.update(time_steps(args, tr))
    print(json.dumps(res), flush=True)
    rows = publish_rows(tr, args.device, int(args.full_sample_gb * 2**30))
    sample = rows["full_sample"]
    scale = base_bytes / sample["bytes"]
    rows["full_scaled"] = {"bytes": base_bytes, "scaled_from_sample": True,
                           **{k: sample[k] * scale for k in ("publish_s", "publish_to_loaded_s")}}
    res["versions"] = rows
    res["adapter_bytes_ratio"] = rows["lora"]["bytes"] / base_bytes
    res["adapter_publish_ratio"] = rows["lora"]["publish_s"] / rows["full_scaled"]["publish_s"]
    print(json.dumps(res) if args.json else json.dumps(res, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
