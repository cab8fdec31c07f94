"""Decode attention that reads the paged KV pool in place (FlexAttention) instead of a gathered copy.

The paged cache's default decode (:meth:`PagedKVCache.update`, ``attention="gather"``) copies
each slot's blocks into a contiguous ``[B, Hkv, span, D]`` tensor in every layer, so the K/V
are read, written and read again, where the static cache reads them once. Here attention runs on
the pool itself, seen as one long sequence ``[1, Hkv, N*BS, D]``, and a FlexAttention
``BlockMask`` names each row's blocks straight from the block table: the blocks before the one
holding ``pos[b]`` are attended whole, that one up to ``pos[b]``. The kernel visits only those
blocks. All ops are device ops on the persistent table and ``pos`` (capturable in a CUDA graph).

FlexAttention's uncompiled fallback does not honour a mask given as block lists, so the kernel
always runs compiled (once per shape; the pool shape is fixed, so once per engine).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Made here, not lazily inside the decode step: there dynamo would trace the assignment and replay it with
# the plain flex_attention, whose uncompiled fallback later engines in the process would then call.
_compiled_flex = torch.compile(flex_attention, dynamic=False)


def pool_sequence(pool: torch.Tensor) -> torch.Tensor:
    """The pool ``[N, BS, Hkv, D]`` as one sequence ``[1, Hkv, N*BS, D]`` (a view, no copy)."""
    n, bs, h, d = pool.shape
    return pool.view(n * bs, h, d).permute(1, 0, 2)[None]


def decode_block_mask(table: torch.Tensor, pos: torch.Tensor, block_size: int, num_blocks: int,
                      in_last_block) -> BlockMask:
    """Blocks each decode query attends: table ``[B, M]`` (pool block of each slot's positions),
    pos ``[B]`` (the position each row writes this step); ``in_last_block`` is the mask_mod of
    the partly attended block (see :func:`last_block_mask_mod`)."""
    b, m = table.shape
    last = pos // block_size                                           # [B] block holding pos
    full_num = last.view(b, 1, 1).to(torch.int32)                      # blocks attended whole
    full_idx = F.pad(table, (0, num_blocks - m)).view(b, 1, 1, num_blocks).to(torch.int32)
    part_idx = F.pad(table.gather(1, last[:, None]), (0, num_blocks - 1)).view(b, 1, 1, num_blocks).to(torch.int32)
    part_num = torch.ones(b, 1, 1, dtype=torch.int32, device=table.device)
    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(1, block_size),
                                    mask_mod=in_last_block, seq_lengths=(1, num_blocks * block_size),
                                    compute_q_blocks=False)


def last_block_mask_mod(pos: torch.Tensor, block_size: int):
    """mask_mod of the block holding ``pos[b]``: its offsets up to ``pos[b]``'s (``pos`` is read
    when the kernel runs, so one function serves every step)."""
    def in_last_block(b, h, q_idx, kv_idx):
        return kv_idx % block_size <= pos[b] % block_size
    return in_last_block


def flex_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask,
                          scale: float | None) -> torch.Tensor:
    """query ``[B, Hq, 1, D]``, key/value ``[1, Hkv, N*BS, D]`` (the paged pool, :func:`pool_sequence`) or
    ``[B, Hkv, S, D]`` (the static cache); returns ``[B, 1, Hq, D]`` like HF's attention kernels."""
    b = query.shape[0]
    out = _compiled_flex(query, key.expand(b, -1, -1, -1), value.expand(b, -1, -1, -1), block_mask=block_mask,
                         scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)
