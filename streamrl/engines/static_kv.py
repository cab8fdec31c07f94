"""Static-cache pieces of the fast transformers engine: attention kernel, KV cache, sampler.

* :func:`static_attention` is registered with transformers as ``streamrl_static_kv``; decoder
  layers call it with the K/V that :class:`StaticKVCache` returns (grouped-query heads folded
  into the query axis at decode, so each cached KV head is read once).
* :class:`StaticKVCache`: per-layer ``[B, Hkv, S, D]`` slots written in place (prefill, decode,
  and forks of a shared prompt's rows). With ``flex`` it also gives the decode step a FlexAttention
  ``BlockMask`` (:meth:`StaticKVCache.decode_block_mask`): each row attends its own written blocks
  of the whole cache, and FlexAttention's decoding kernel splits those blocks over the GPU (the
  sdpa kernels give one CTA per (row, KV head) a whole span to walk: latency-bound at batch 256).
* :func:`sample_tokens`: the device-side draw and its behaviour log-prob (no host sync).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface

from streamrl.engines.host_io import to_device
from streamrl.engines.paged_flex import flex_decode_attention

FLEX_BLOCK = 128
"""KV positions per FlexAttention block of the static cache (a multiple of the decoding kernel's tile)."""

ATTN = "streamrl_static_kv"
"""Name of the attention kernel registered with transformers (selected inside the engine only)."""


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA over the static cache; query ``[B, Hq, q, D]``, key/value ``[B, Hkv, S, D]``,
    attention_mask bool ``[B|1, 1, q, S]``; returns ``([B, q, Hq, D], None)`` like HF's kernels. A
    ``BlockMask`` instead means a decode step over the whole paged pool or static cache, each row bounded by
    the mask (:mod:`streamrl.engines.paged_flex`)."""
    if isinstance(attention_mask, BlockMask):  # paged decode reading the pool in place
        return flex_decode_attention(query, key, value, attention_mask, scaling), None
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    if q == 1 and groups > 1:
        # Decode: fold the query heads that share a KV head into the query axis, so the kernel
        # reads each cached KV head once instead of a repeat_kv copy of the whole cache. Head
        # h = kv * groups + g (repeat_kv's order). The kernels may return [b, hkv, groups, d]
        # with any strides (CUDA's come back non-contiguous), so reshape, never view.
        out = F.scaled_dot_product_attention(query.reshape(b, hkv, groups, d), key, value,
                                             attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, 1, hq, d), None
    else:
        if groups > 1:
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN, static_attention)


class StaticKVCache:
    """Per-layer K/V ``[B, Hkv, S, D]``; HF attention calls :meth:`update` with the new keys.

    Prefill mode writes ``key [n, Hkv, P, D]`` for slots ``rows`` at positions ``0..P-1`` and
    returns the prompt's own K/V; with ``start`` ([n], a kept session's reused length) it writes
    row ``i`` at ``start[i]..start[i]+P-1`` and returns the rows' first ``span`` positions. Decode
    mode writes ``key [n, Hkv, 1, D]`` of slots ``rows`` (all ``B``, or an eager step's live rows)
    at ``pos`` and returns those slots' first ``span`` positions (fixed shape per captured graph).
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device,
                 flex: bool = False):
        if flex:  # whole FlexAttention blocks
            max_len = -(-max_len // FLEX_BLOCK) * FLEX_BLOCK
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.span = max_len
        self.prefill = False
        self.start: torch.Tensor | None = None
        self._upto_pos = None  # flex: mask_mod reading the decode positions
        n = max_len // FLEX_BLOCK
        self._all_blocks = (torch.arange(n, dtype=torch.int32, device=device).expand(batch, 1, 1, n).contiguous()
                            if flex else None)

    # Host-side interface shared with PagedKVCache: a static slot always has room.
    span_quantum = 1
    num_blocks = free_blocks = 1 << 62
    peak_blocks = 0

    @property
    def max_span(self) -> int:
        return self.k[0].shape[2]

    def bytes(self) -> int:
        """Device bytes of the cache (K and V, all layers)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def blocks_for(self, length: int) -> int:
        return 0

    def grow(self, slots: list[int], lengths: list[int]) -> list[int]:
        return []

    def release(self, slots: list[int]) -> None:
        pass

    # A kept session (streamrl.engines.kv_sessions) keeps its K/V where it is: in its slot.
    def detach(self, slot: int, length: int) -> int:
        return slot

    def attach(self, slot: int, handle: int, length: int) -> None:
        assert slot == handle, "a static session resumes in its own slot"

    def drop(self, handle: int) -> None:
        pass

    def extra_blocks_to_resume(self, handle: int, length: int) -> int:
        return 0

    def fork(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Copy positions ``0..lengths[i]-1`` of slot ``src[i]`` into slot ``dst[i]`` (a shared prefix)."""
        dev = self.k[0].device
        n = max(lengths)
        fr, to = to_device(src, dev), to_device(dst, dev)
        for k, v in zip(self.k, self.v):
            k[to, :, :n] = k[fr, :, :n]
            v[to, :, :n] = v[fr, :, :n]

    def decode_block_mask(self, pos: torch.Tensor) -> BlockMask:
        """Blocks each decode row attends, pos ``[B]`` (the position it writes this step): blocks before
        the one holding ``pos[b]`` whole, that one up to ``pos[b]`` (device ops only: captured as is).
        ``pos`` must be the same tensor at every step (the mask_mod reads it when the kernel runs)."""
        if self._upto_pos is None:
            self._upto_pos = lambda b, h, q_idx, kv_idx: kv_idx <= pos[b]
        b, n = pos.shape[0], self._all_blocks.shape[-1]
        last = (pos // FLEX_BLOCK).to(torch.int32)  # [B] block holding pos
        part_idx = F.pad(last.view(b, 1, 1, 1), (0, n - 1))
        part_num = torch.ones(b, 1, 1, dtype=torch.int32, device=pos.device)
        return BlockMask.from_kv_blocks(part_num, part_idx, last.view(b, 1, 1), self._all_blocks,
                                        BLOCK_SIZE=FLEX_BLOCK, mask_mod=self._upto_pos,
                                        seq_lengths=(1, self.max_span), compute_q_blocks=False)

    def at_layer(self, layer: int) -> None:
        """Select the layer whose K/V the next :meth:`update` writes. The engine calls it before each
        layer, so a compiled layer never reads its own index and one graph serves every layer."""
        self.layer_k, self.layer_v = self.k[layer], self.v[layer]

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = self.layer_k, self.layer_v  # the layer at_layer selected (layer_idx is that layer's)
        if self.prefill and self.start is not None:
            at = (self.start[:, None] + torch.arange(key.shape[2], device=key.device)).clamp_(max=k.shape[2] - 1)
            k[self.rows[:, None], :, at] = key.transpose(1, 2)  # [n, P, Hkv, D] at (row, position)
            v[self.rows[:, None], :, at] = value.transpose(1, 2)
            return k[self.rows, :, : self.span], v[self.rows, :, : self.span]
        if self.prefill:
            p = key.shape[2]
            k[self.rows, :, :p] = key
            v[self.rows, :, :p] = value
            return key, value
        k[self.rows, :, self.pos] = key[:, :, 0]
        v[self.rows, :, self.pos] = value[:, :, 0]
        if self.rows.shape[0] < k.shape[0]:  # an eager step of the live rows only: their K/V (a copy)
            return k[self.rows, :, : self.span], v[self.rows, :, : self.span]
        return k[:, :, : self.span], v[:, :, : self.span]


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor | None, top_k: int = 0, top_p: float = 1.0,
                  scratch: torch.Tensor | None = None):
    """Draw one token per row on the device, no host sync.

    logits: [n, V] float32; temperature: [1] device scalar, or None for greedy (argmax).
    scratch: optional ``[2, >= n, V]`` float32 buffers kept by the caller for the log-probs and the
    noise; with them the draw also works in place in ``logits`` (overwritten). Same tokens and log-probs, bit for bit
    (same kernels, same random stream); on the CPU each fresh ``[64, 49152]`` temporary costs its
    page faults, and without them the sampler's share of a SmolLM2 decode step drops (see
    :class:`~streamrl.engines.hf_fast.FastHFEngine`, which passes it on CPU only).
    Returns ``(tokens [n] long, logprobs [n] float32)``: log-prob of each token under the
    distribution it was drawn from (tempered, then top-k/top-p truncated and renormalised;
    untempered softmax for greedy).
    """
    if temperature is None:
        logp = F.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    z = logits / temperature if scratch is None else logits.div_(temperature)
    if top_k > 0:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sz, si = z.sort(dim=-1, descending=True)
        probs = sz.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) > top_p  # mass before a token; the top one stays
        z = torch.empty_like(z).scatter_(-1, si, sz.masked_fill(drop, float("-inf")))
    logp = F.log_softmax(z, dim=-1) if scratch is None else torch.log_softmax(z, -1, out=scratch[0, : z.shape[0]])
    # Gumbel-max in exponential form: argmax p / E, E ~ Exp(1), is a draw from p. E = -log U,
    # U ~ Uniform[0, 1): ~3x cheaper than exponential_() on the CPU ([64, 49152], 1 thread:
    # ~56 vs 160-200 ms per decode step, 14 % of a SmolLM2 worker's batch); U = 0 gives
    # E = inf, which only leaves out that token for that draw (p ~ 6e-8).
    if scratch is None:
        tok = (logp.exp() / torch.rand_like(logp).log_().neg_()).argmax(dim=-1)
    else:  # z is spent: p = exp(logp) goes there, the noise into the scratch rows
        noise = scratch[1, : logp.shape[0]].uniform_().log_().neg_()
        tok = torch.exp(logp, out=z).div_(noise).argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
