"""The two largest pieces of hf_fast's MoE decode step on the GPU, each variant timed alone.

    python3 tools/gpu/decode_kernels_bench.py [BATCH=256] [SPANS=512,1024]

Attention at decode (a profile of the 1.04 B MoE at batch 256, span 1,024: cuDNN's
flash kernel, 131 us a layer, ~43 % of HBM bandwidth): query ``[B, Hkv, G, D]`` (grouped heads
folded into the query axis, as ``static_attention`` does), K/V ``[B, Hkv, S, D]``, a bool mask
``[B, 1, 1, S]`` of each row's written positions. Variants: sdpa as today (backend picked by
torch), sdpa forced to the memory-efficient kernel, two matmuls with a masked softmax (eager and
compiled). Expert dispatch (radix sort 29 us a layer): ``torch.sort`` + ``histc`` (transformers'
grouped_mm path) against a counting sort by one-hot cumsum. One JSON line per variant: us per
call and, for attention, the HBM bandwidth the K/V read implies.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
SPANS = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "512,1024").split(",")]
HKV, G, D, E, K = 4, 4, 64, 64, 8  # the moe-1b preset: 16 query heads, 4 KV heads, 64 experts, top-8
dev, dt = "cuda", torch.bfloat16


def timed(fn, iters=50):
    """Median-free mean of ``iters`` calls between CUDA events, after 5 warm-up calls (us)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def two_matmuls(q, k, v, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(p.to(v.dtype), v)


def emit(**kw):
    print(json.dumps(kw), flush=True)


for S in SPANS:
    q = torch.randn(B, HKV, G, D, device=dev, dtype=dt)
    k, v = (torch.randn(B, HKV, S, D, device=dev, dtype=dt) for _ in range(2))
    lens = torch.randint(S // 2, S + 1, (B,), device=dev)
    mask = (torch.arange(S, device=dev) < lens[:, None])[:, None, None, :]
    scale = D ** -0.5
    kv_bytes = 2 * k.numel() * k.element_size()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    compiled = torch.compile(two_matmuls, dynamic=False)
    variants = {
        "sdpa_default": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
        "sdpa_efficient": lambda: _efficient(q, k, v, mask, scale),
        "two_matmuls": lambda: two_matmuls(q, k, v, mask, scale),
        "two_matmuls_compiled": lambda: compiled(q, k, v, mask, scale),
    }

    def _efficient(q, k, v, mask, scale):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    for name, fn in variants.items():
        try:
            err = (fn().float() - ref.float()).abs().max().item()
            us = timed(fn)
            emit(kernel="attention", variant=name, batch=B, span=S, us=round(us, 1),
                 tb_s=round(kv_bytes / us / 1e6, 2), max_abs_diff=err)
        except Exception as e:  # a backend that refuses the shapes: say so, go on
            emit(kernel="attention", variant=name, batch=B, span=S, error=f"{type(e).__name__}: {e}"[:300])

ids = torch.randint(0, E, (B, K), device=dev).reshape(-1)


def sort_histc(ids):
    ids_g, perm = torch.sort(ids)
    counts = torch.histc(ids_g.int(), bins=E, min=0, max=E - 1)
    return perm, torch.cumsum(counts, 0, dtype=torch.int32)


def counting_sort(ids):
    onehot = F.one_hot(ids, E)                                  # [S, E]
    counts = onehot.sum(0)                                      # [E]
    ends = torch.cumsum(counts, 0)
    rank = (torch.cumsum(onehot, 0) * onehot).sum(1) - 1        # order within the pair's expert
    dest = ends[ids] - counts[ids] + rank                       # sorted slot of each pair
    perm = torch.empty_like(ids).scatter_(0, dest, torch.arange(ids.numel(), device=ids.device))
    return perm, ends.to(torch.int32)


p0, o0 = sort_histc(ids)
for name, fn in {"sort_histc": sort_histc, "counting_sort": counting_sort,
                 "sort_histc_compiled": torch.compile(sort_histc, dynamic=False),
                 "counting_sort_compiled": torch.compile(counting_sort, dynamic=False)}.items():
    try:
        p, o = fn(ids)
        same = bool(torch.equal(ids[p], ids[p0]) and torch.equal(o.int(), o0.int()))
        emit(kernel="dispatch", variant=name, pairs=ids.numel(), experts=E, us=round(timed(lambda: fn(ids)), 1),
             grouped_same=same, stable_same=bool(torch.equal(p, p0)))
    except Exception as e:
        emit(kernel="dispatch", variant=name, error=f"{type(e).__name__}: {e}"[:300])
