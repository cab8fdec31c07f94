"""Decode attention of one layer over a paged KV pool: what the gather costs, and FlexAttention instead.

The paged cache (:mod:`streamrl.engines.paged_kv`) gathers every slot's blocks into a contiguous
``[B, Hkv, span, D]`` copy in every layer of every decode step, then runs SDPA on it: the K/V
are read twice and written once, where the static cache reads them once. This times, for one
layer at the 1 B MoE's attention shape (Hq 16, Hkv 4, D 64, bf16):

* ``static``: SDPA over a contiguous ``[B, Hkv, span, D]`` cache (the engine's static path,
  query heads folded onto their KV head);
* ``gather``: the paged path as it is (block gather + SDPA);
* ``flex``: ``torch.compile``'d FlexAttention reading the pool in place: a BlockMask whose KV
  blocks are the slot's table entries (full blocks unmasked, the last one masked at ``pos``).

and the max abs difference of ``gather``/``flex`` to ``static``. One JSON line per (span, block).

    python3 tools/gpu/paged_attn_bench.py                 # B=256, spans 512 1024, blocks 16 64
    python3 tools/gpu/paged_attn_bench.py 256 1024 16     # one case
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

HQ, HKV, D, LAYERS = 16, 4, 64, 24


def _time(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def case(b: int, span: int, bs: int, dev: str = "cuda", dtype=torch.bfloat16) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    nb = span // bs
    n = b * nb + 1                                                    # pool blocks, 0 = trash
    kp = torch.randn(n, bs, HKV, D, generator=g).to(dev, dtype)        # pool [N, BS, Hkv, D]
    vp = torch.randn(n, bs, HKV, D, generator=g).to(dev, dtype)
    table = (torch.randperm(n - 1, generator=g)[: b * nb] + 1).view(b, nb).to(dev)  # [B, nb]
    pos = torch.randint(span // 2, span, (b,), generator=g).to(dev)   # last written position per row
    q = torch.randn(b, HQ, 1, D, generator=g).to(dev, dtype)
    allowed = torch.arange(span, device=dev)[None, :] <= pos[:, None]
    mask = torch.zeros(b, 1, 1, span, dtype=dtype, device=dev).masked_fill_(~allowed[:, None, None], float("-inf"))
    groups = HQ // HKV
    static_k = kp[table].view(b, span, HKV, D).transpose(1, 2).contiguous()  # [B, Hkv, span, D]
    static_v = vp[table].view(b, span, HKV, D).transpose(1, 2).contiguous()

    def static():
        return F.scaled_dot_product_attention(q.view(b, HKV, groups, D), static_k, static_v, attn_mask=mask)

    def gather():
        k = kp[table].view(b, span, HKV, D).transpose(1, 2)
        v = vp[table].view(b, span, HKV, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(b, HKV, groups, D), k, v, attn_mask=mask)

    ref = static().reshape(b, HQ, D).float()
    out = {"batch": b, "span": span, "block_size": bs, "layers": LAYERS}
    for name, fn in (("static", static), ("gather", gather)):
        out[f"{name}_ms_per_layer"] = round(_time(fn), 4)
    out["gather_max_abs_diff"] = float((gather().reshape(b, HQ, D).float() - ref).abs().max())
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        kflat = kp.view(n * bs, HKV, D).permute(1, 0, 2)[None]  # [1, Hkv, N*BS, D] (a view of the pool)
        vflat = vp.view(n * bs, HKV, D).permute(1, 0, 2)[None]
        last = pos // bs

        def block_mask():  # device ops only (capturable): rebuilt from table/pos every step
            full_num = last.view(b, 1, 1).int()
            full_idx = F.pad(table, (0, n - nb)).view(b, 1, 1, n).int()
            part_idx = F.pad(table.gather(1, last[:, None]), (0, n - 1)).view(b, 1, 1, n).int()
            part_num = torch.ones(b, 1, 1, dtype=torch.int32, device=dev)

            def in_last_block(bi, h, q_idx, kv_idx):
                return kv_idx % bs <= pos[bi] % bs
            return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(1, bs),
                                            mask_mod=in_last_block, seq_lengths=(1, n * bs))

        def flex_step():
            return flex(q, kflat.expand(b, -1, -1, -1), vflat.expand(b, -1, -1, -1), block_mask=block_mask(),
                        enable_gqa=True)

        out["flex_ms_per_layer"] = round(_time(flex_step), 4)
        out["flex_max_abs_diff"] = float((flex_step().reshape(b, HQ, D).float() - ref).abs().max())
    except Exception as e:  # noqa: BLE001 - report what FlexAttention does not support here
        out["flex_error"] = repr(e)[:300]
    kv_gb = 2 * b * HKV * span * D * kp.element_size() / 1e9
    out["kv_gb_per_layer"] = round(kv_gb, 4)
    out["step_ms_attention_static_gather_flex"] = [round(out.get(f"{k}_ms_per_layer", float("nan")) * LAYERS, 2)
                                                   for k in ("static", "gather", "flex")]
    return out


def main() -> None:
    b = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    spans = [int(sys.argv[2])] if len(sys.argv) > 2 else [512, 1024]
    blocks = [int(sys.argv[3])] if len(sys.argv) > 3 else [16, 64]
    for span in spans:
        for bs in blocks:
            print(json.dumps(case(b, span, bs)), flush=True)


if __name__ == "__main__":
    main()
