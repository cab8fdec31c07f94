"""Measure one learner training step of a Qwen3-MoE in bf16: tokens/s and achieved TFLOP/s.

The step is the learner's: forward through the expert-parallel MoE blocks (grouped GEMM for
the experts), next-token log-probs, the PPO-clip + truncated-IS policy loss, router aux loss,
backward, AdamW. Only torch and transformers are needed (no tensordict), so it runs on the
GPU machine as is. One GPU::

    python -m streamrl.bench.learner_step --layers 12 --hidden 1024 --experts 64 --topk 4 \\
        --moe-inter 512 --batch 16 --seq 1024 --steps 10

Several GPUs (expert parallel over all of them, FSDP2 for the rest)::

    torchrun --nproc_per_node 2 -m streamrl.bench.learner_step --ep 2 ...

Model FLOPs per token (forward + backward = 3x forward): ``6 * N_active`` (matmul parameters
a token touches: attention projections, top-k experts, router, lm_head) plus causal attention
``6 * L * seq * n_heads * head_dim``. Achieved TFLOP/s is divided by ``--peak`` (per GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from streamrl.algorithms.losses import policy_loss
from streamrl.algorithms.moe_losses import load_balancing_loss
from streamrl.parallel.expert_parallel import compile_decoder_layers, parallelize
from streamrl.parallel.mesh import build_mesh


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=16, help="sequences per GPU")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--impl", default="grouped_mm", choices=["grouped_mm", "loop", "hf_grouped_mm", "hf_eager"],
                   help="experts kernel: ours (grouped_mm/loop) or transformers' own block")
    p.add_argument("--peak", type=float, default=790.0, help="bf16 matmul peak TFLOP/s per GPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="", help="write the result JSON here too")
    p.add_argument("--profile", type=int, default=0,
                   help="also profile this many steps and print where device time goes (by kernel family)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (fullgraph off)")
    return p.parse_args(argv)


def build(args, device):
    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.moe_inter,
        moe_intermediate_size=args.moe_inter, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
        num_experts_per_tok=args.topk, norm_topk_prob=True, max_position_embeddings=max(args.seq, 128),
        tie_word_embeddings=False, output_router_logits=False,
    )
    if args.impl.startswith("hf_"):
        cfg._experts_implementation = args.impl[3:]
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    return model, cfg


def count_flops(args, total_params: int) -> tuple[float, float, float]:
    """(total params, active matmul params per token, train FLOPs per token)."""
    h, L = args.hidden, args.layers
    attn = h * args.heads * args.head_dim * 2 + h * args.kv_heads * args.head_dim * 2
    experts = args.topk * 3 * h * args.moe_inter
    router = h * args.experts
    active = L * (attn + experts + router) + h * args.vocab  # lm_head; embedding lookup is not a matmul
    per_token = 6 * active + 6 * L * args.seq * args.heads * args.head_dim  # causal: half of 12
    return float(total_params), float(active), float(per_token)


# Kernel-name fragments -> family, first match wins (CUDA kernel names of torch 2.11 on H200).
_FAMILIES = (
    ("grouped_gemm (experts)", ("grouped", "gmm", "cutlass3x_sm90_bstensorop", "device_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("gemm (dense)", ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet")),
    ("softmax / log_softmax", ("softmax", "logsumexp")),
    ("index / sort / scatter (dispatch)", ("index", "sort", "scatter", "gather", "radix", "bincount", "cumsum",
                                          "histogram", "repeat_interleave", "unique")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "cat")),
)


def profile_breakdown(step, n: int, device, sync, table_path: str = "", top: int = 15) -> dict:
    """Device time per kernel family over ``n`` steps, plus the ``top`` kernels overall and the
    ``top`` kernels of the family "other" (the ones no family name matched), ms per step.

    ``table_path``: also write torch.profiler's whole table, by self device time (CPU time on
    CPU), there.
    """
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        sync()
    rows = []
    for e in prof.key_averages():
        if device.type == "cuda":
            # kernels only: an aten op's device time is the sum of its kernels, counted already
            t = e.self_device_time_total if e.device_type == DeviceType.CUDA else 0
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((e.key, t / 1e3 / n))
    fam: dict[str, float] = {}
    other = []
    for name, ms in rows:
        low = name.lower()
        f = next((f for f, keys in _FAMILIES if any(k in low for k in keys)), "other")
        fam[f] = fam.get(f, 0.0) + ms
        if f == "other":
            other.append((name, ms))
    total = sum(fam.values())
    if table_path:
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(table_path, "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=-1, max_name_column_width=120))

    def largest(kernels):
        return [[k[:90], round(v, 3)] for k, v in sorted(kernels, key=lambda r: -r[1])[:top]]

    return {"device_ms_per_step": round(total, 2),
            "families_ms": {k: round(v, 2) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": largest(rows), "top_other_kernels_ms": largest(other)}


def _init(args) -> tuple[int, int, torch.device]:
    """(world, rank, device) of this process; a process group when launched by torchrun."""
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.device != "cuda":
        return world, rank, torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return world, rank, torch.device("cuda", torch.cuda.current_device())


def _make_step(args, model, blocks, device: torch.device, rank: int):
    """One training step on a fixed random batch (policy loss + load balancing, AdamW) as a closure."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    attn = torch.ones_like(ids)
    mask = torch.ones(args.batch, args.seq - 1, device=device)
    behav = -torch.rand(args.batch, args.seq - 1, generator=g).to(device) * 3
    adv = torch.randn(args.batch, generator=g).to(device)

    def step():
        out = model(input_ids=ids, attention_mask=attn, use_cache=False)
        lp = F.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss, _ = policy_loss(lp, lp.detach(), behav, adv, mask)
        if blocks:
            loss = loss + 0.01 * load_balancing_loss([b.last_router_logits for b in blocks], args.experts, args.topk)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main(argv=None) -> int:
    args = parse_args(argv)
    world, rank, device = _init(args)
    model, cfg = build(args, device)
    total = sum(p.numel() for p in model.parameters())
    blocks = []
    if args.impl.startswith("hf_"):
        if world > 1:
            raise SystemExit("--impl hf_* runs on one GPU only")
        model.to(device)
    else:
        blocks = parallelize(model, build_mesh(args.ep, device.type, args.experts), device, args.impl,
                             mixed_precision=False)
    model.train()
    step = _make_step(args, model, blocks, device, rank)
    if args.compile:
        compile_decoder_layers(model)  # after parallelize: FSDP wraps the module, forward is swapped
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    total_p, active, per_tok = count_flops(args, total)
    tokens = args.batch * args.seq
    tflops = per_tok * tokens / dt / 1e12
    res = {
        "impl": args.impl, "world": world, "ep": args.ep, "params_total_B": total_p / 1e9,
        "params_active_matmul_M": active / 1e6, "tokens_per_step_per_gpu": tokens, "step_s": dt,
        "tokens_per_s_per_gpu": tokens / dt, "tokens_per_s_total": tokens * world / dt,
        "tflops_per_gpu": tflops, "mfu_vs_peak": tflops / args.peak,
        "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
    }
    if args.profile:
        res["profile"] = profile_breakdown(step, args.profile, device, sync)
    if rank == 0:
        print(json.dumps(res, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
