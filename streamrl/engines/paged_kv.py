"""Paged KV cache of the fast transformers engine: memory by use instead of a slot per maximum length.

The static cache (:class:`streamrl.engines.static_kv.StaticKVCache`) reserves ``B x S``
positions per layer: 256 sequences of up to 8k tokens of a 24-layer, 4-KV-head, 64-dim bf16
model take 48 GiB whether they stop at 300 tokens or run to 8k. Here the K/V live in a pool
of fixed-size blocks shared by all slots:

* **Pool** ``[N, BS, Hkv, D]`` per layer (``N`` blocks of ``BS`` positions); block 0 is a
  trash block that unallocated table entries point at, so idle and finished rows of the
  fixed-shape decode step write somewhere harmless.
* **Block table** ``[B, M]`` (device, ``M = ceil(S / BS)``): block of each slot's positions
  ``m*BS .. m*BS+BS-1``. The host keeps the same table as lists plus a reference count per
  block, allocates a block when a sequence reaches a new one (:meth:`grow`) and frees a
  slot's blocks when it is harvested or preempted (:meth:`release`).
* **Shared prompts**: a group's full prompt blocks are referenced by all G samples
  (:meth:`fork`); only the partly filled last block is copied, since each sample writes its
  own tokens into it (copy-on-write done at the fork: the first decode step writes it anyway).
* **Decode reads** gather the table's first ``span / BS`` blocks of every slot into
  ``[B, Hkv, span, D]`` (strided view of one gather): fixed shapes per span bucket, so the
  step stays capturable in a CUDA graph. With ``attention="flex"`` nothing is gathered:
  FlexAttention reads the pool in place through the table (:mod:`streamrl.engines.paged_flex`).

All device ops of :meth:`update` read persistent buffers (pool, table, ``rows``/``pos``), so
host-side table edits between graph replays are seen by the next replay.
"""
from __future__ import annotations

import torch

from streamrl.engines.host_io import to_device
from streamrl.engines.paged_flex import decode_block_mask, last_block_mask_mod, pool_sequence

PAGED_ATTENTION = ("gather", "flex")


def pool_blocks(pool_bytes: int, layers: int, kv_heads: int, head_dim: int, element_size: int,
                block_size: int) -> int:
    """Blocks (trash block included) of a pool of ``pool_bytes`` for K and V of every layer."""
    per_block = 2 * layers * kv_heads * head_dim * element_size * block_size
    return max(2, pool_bytes // per_block + 1)


class PagedKVCache:
    """Block pool + block tables with the interface of :class:`StaticKVCache` (``update``, ``fork``).

    Args:
        layers / batch / kv_heads / head_dim / dtype / device: model and engine shapes.
        max_len: longest sequence a slot may hold (``S``).
        block_size: positions per block (``BS``).
        num_blocks: pool size including the trash block; default ``batch * ceil(S / BS) + 1``
            (as much as the static cache: never preempts).
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device,
                 block_size: int = 16, num_blocks: int | None = None, attention: str = "gather"):
        if block_size < 1:
            raise ValueError(f"block_size = {block_size}: must be >= 1")
        if attention not in PAGED_ATTENTION:
            raise ValueError(f"paged attention = {attention!r}: must be one of {PAGED_ATTENTION}")
        self.attention = attention
        self._in_last_block = None  # flex: mask_mod reading the decode positions
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)  # M: table width
        self.max_span = self.max_blocks * block_size
        self.num_blocks = num_blocks if num_blocks is not None else batch * self.max_blocks + 1
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks = {self.num_blocks}: must be >= 2 (block 0 is the trash block)")
        shape = (self.num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.table = torch.zeros(batch, self.max_blocks, dtype=torch.long, device=device)  # 0 = trash
        self.device = torch.device(device)
        self.slot_blocks: list[list[int]] = [[] for _ in range(batch)]
        self.refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self.rows: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.span = self.max_span
        self.prefill = False
        self.start: torch.Tensor | None = None  # prefill of kept sessions: first new position per row
        self.peak_blocks = 0  # most blocks in use at once (memory actually needed)

    # ------------------------------------------------------------------ host-side bookkeeping
    @property
    def span_quantum(self) -> int:
        """Attended spans must be multiples of this (whole blocks are gathered)."""
        return self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def bytes(self) -> int:
        """Device bytes of the pool (K and V, all layers)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def blocks_for(self, length: int) -> int:
        """Blocks covering positions ``0..length-1``."""
        return -(-length // self.block_size)

    def _take(self) -> int | None:
        if not self._free:
            return None
        b = self._free.pop()
        self.refs[b] = 1
        self.peak_blocks = max(self.peak_blocks, self.num_blocks - 1 - len(self._free))
        return b

    def _write_table(self, edits: list[tuple[int, int, int]]) -> None:
        """Apply ``(slot, index, block)`` edits to the device table in one indexed write."""
        if edits:
            s, m, b = zip(*edits)
            self.table[to_device(s, self.device), to_device(m, self.device)] = to_device(b, self.device)

    def grow(self, slots: list[int], lengths: list[int]) -> list[int]:
        """Give each slot blocks for positions ``0..lengths[i]-1``; returns the slots the pool could not serve."""
        edits, short = [], []
        for s, n in zip(slots, lengths):
            have = self.slot_blocks[s]
            while len(have) < self.blocks_for(n):
                b = self._take()
                if b is None:
                    short.append(s)
                    break
                edits.append((s, len(have), b))
                have.append(b)
        self._write_table(edits)
        return short

    def release(self, slots: list[int]) -> None:
        """Drop the slots' references (a block is free when no slot holds it); rows point at trash."""
        for s in slots:
            for b in self.slot_blocks[s]:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self._free.append(b)
            self.slot_blocks[s] = []
        if slots:
            self.table[to_device(slots, self.device)] = 0

    def detach(self, slot: int, length: int) -> list[int]:
        """Take slot ``slot``'s blocks covering positions ``0..length-1`` out of the slot (a kept
        session, :mod:`streamrl.engines.kv_sessions`); blocks past them are freed."""
        keep = self.blocks_for(length)
        blocks = self.slot_blocks[slot]
        self.slot_blocks[slot] = blocks[keep:]
        self.release([slot])
        return blocks[:keep]

    def attach(self, slot: int, blocks: list[int], length: int) -> None:
        """Give the empty slot ``slot`` a kept session's blocks, of which positions ``0..length-1``
        are reused; later blocks are freed, and a shared block the slot will write is copied."""
        assert not self.slot_blocks[slot], "attach into a slot that holds blocks"
        keep = self.blocks_for(length)
        self.drop(blocks[keep:])
        own = list(blocks[:keep])
        last = length // self.block_size  # block of the first new position
        if length % self.block_size and self.refs[own[last]] > 1:  # written next: make it the slot's own
            b = self._take()
            if b is None:
                raise RuntimeError("KV pool exhausted while resuming a kept session (admission undercounted)")
            for k, v in zip(self.k, self.v):
                k[b] = k[own[last]]
                v[b] = v[own[last]]
            self.refs[own[last]] -= 1
            own[last] = b
        self.slot_blocks[slot] = own
        self._write_table([(slot, m, b) for m, b in enumerate(own)])

    def extra_blocks_to_resume(self, blocks: list[int], length: int) -> int:
        """New blocks a kept session resumed at ``length`` needs beyond a fresh prompt's count
        (negative: the reused blocks it brings; +1 when its partly filled block is shared)."""
        cow = length % self.block_size != 0 and self.refs[blocks[length // self.block_size]] > 1
        return int(cow) - self.blocks_for(length)

    def drop(self, blocks: list[int]) -> None:
        """Free a kept session's blocks (those no other sequence references)."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)

    def fork(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Slot ``dst[i]`` shares the prompt K/V of slot ``src[i]`` (positions ``0..lengths[i]-1``).

        Full blocks are referenced, not copied; a partly filled last block is copied into a
        new block of ``dst[i]`` (its sample's tokens go there). ``dst`` slots hold no blocks.
        """
        edits, copy_from, copy_to = [], [], []
        for a, d, n in zip(src, dst, lengths):
            assert not self.slot_blocks[d], "fork into a slot that holds blocks"
            full, partial = divmod(n, self.block_size)
            shared = self.slot_blocks[a][:full]
            for b in shared:
                self.refs[b] += 1
            self.slot_blocks[d] = list(shared)
            edits += [(d, m, b) for m, b in enumerate(shared)]
            if partial:
                b = self._take()
                if b is None:
                    raise RuntimeError("KV pool exhausted inside an admitted prefill (admission undercounted)")
                copy_from.append(self.slot_blocks[a][full])
                copy_to.append(b)
                edits.append((d, full, b))
                self.slot_blocks[d].append(b)
        self._write_table(edits)
        if copy_to:
            fr, to = to_device(copy_from, self.device), to_device(copy_to, self.device)
            for k, v in zip(self.k, self.v):
                k[to] = k[fr]
                v[to] = v[fr]

    # ------------------------------------------------------------------ device side (HF cache API)
    def decode_block_mask(self, pos: torch.Tensor):
        """``attention="flex"``: the BlockMask of this decode step's rows at positions ``pos [B]``
        (the engine's persistent position tensor: the mask_mod reads it when the kernel runs)."""
        if self._in_last_block is None:
            self._in_last_block = last_block_mask_mod(pos, self.block_size)
        return decode_block_mask(self.table, pos, self.block_size, self.num_blocks, self._in_last_block)

    def at_layer(self, layer: int) -> None:
        """Select the layer whose pool the next :meth:`update` writes (see ``StaticKVCache.at_layer``)."""
        self.layer_k, self.layer_v = self.k[layer], self.v[layer]

    def update(self, key, value, layer_idx, *args, **kwargs):
        """Write the new K/V and return what attention reads.

        Prefill: ``key [n, Hkv, P, D]`` for slots ``rows`` at positions ``0..P-1`` (positions past
        a slot's blocks land in trash); returns the prompt's own K/V. Decode: ``key [n, Hkv, 1, D]``
        of slots ``rows`` (all ``B`` or an eager step's live rows) at ``pos``; returns ``[n, Hkv, span,
        D]`` gathered through the table.
        """
        k, v = self.layer_k, self.layer_v  # the layer at_layer selected
        bs = self.block_size
        if self.prefill and self.start is not None:  # kept sessions: new positions after the reused ones
            at = (self.start[:, None] + torch.arange(key.shape[2], device=key.device)).clamp_(max=self.max_span - 1)
            blk = self.table[self.rows[:, None], at // bs]  # [n, P]
            k[blk, at % bs] = key.transpose(1, 2)
            v[blk, at % bs] = value.transpose(1, 2)
            n, nb = self.rows.shape[0], self.span // bs
            ids = self.table[self.rows, :nb]
            return (k[ids].view(n, nb * bs, *k.shape[2:]).transpose(1, 2),
                    v[ids].view(n, nb * bs, *v.shape[2:]).transpose(1, 2))
        if self.prefill:
            p = key.shape[2]
            at = torch.arange(p, device=key.device)
            blk = self.table[self.rows][:, at // bs]  # [n, P]
            k[blk, at % bs] = key.transpose(1, 2)
            v[blk, at % bs] = value.transpose(1, 2)
            return key, value
        blk = self.table[self.rows, self.pos // bs]  # [B]
        k[blk, self.pos % bs] = key[:, :, 0]
        v[blk, self.pos % bs] = value[:, :, 0]
        if self.attention == "flex":  # attention reads the pool in place (decode_block_mask)
            return pool_sequence(k), pool_sequence(v)
        b, nb = self.rows.shape[0], self.span // bs  # all B slots, or an eager step's live rows
        ids = self.table[self.rows, :nb] if b < self.table.shape[0] else self.table[:, :nb]
        # [B, nb, BS, Hkv, D] -> [B, span, Hkv, D] (free view) -> [B, Hkv, span, D] (strided)
        kg = k[ids].view(b, nb * bs, *k.shape[2:]).transpose(1, 2)
        vg = v[ids].view(b, nb * bs, *v.shape[2:]).transpose(1, 2)
        return kg, vg
