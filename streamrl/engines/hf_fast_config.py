"""Configuration of :class:`streamrl.engines.hf_fast.FastHFEngine`: one dataclass, validated once.

:func:`streamrl.engines.factory.fast_hf_config` builds it from a run's ``rollout`` section;
benchmarks and tests build it directly.
"""
from __future__ import annotations

from dataclasses import dataclass

KV_CACHES = ("static", "paged")
PAGED_ATTENTIONS = ("gather", "flex")
DECODE_ATTENTIONS = ("auto", "sdpa", "flex")
FLEX_MIN_LEN = 512
"""Cache positions from which ``decode_attention="auto"`` picks FlexAttention on CUDA: there the sdpa kernel's one CTA
per (row, KV head) walking the whole span is latency-bound (measured at 1,088 and 4,224 positions); below it the
configuration measured with sdpa (SmolLM2 recipe, 256 positions) keeps it."""


@dataclass(frozen=True)
class FastHFConfig:
    """How a :class:`~streamrl.engines.hf_fast.FastHFEngine` decodes.

    Attributes:
        device: torch device of the model, the KV cache and the slot state.
        batch_size: decode slots ``B`` (fixed shape of every step).
        max_seq_len: cache length ``S``; prompt + response must fit (None: the model's
            ``max_position_embeddings``, capped at 4096).
        top_k / top_p: truncation of the sampling distribution (0 / 1.0 = off).
        record_routing: record the experts each MoE layer chose for every sampled token.
        cuda_graphs: capture the decode step (None: on for CUDA devices).
        compile: run the decode step's decoder layers (one compiled graph for all of them) and its
            tail (head, sampling, bookkeeping) through ``torch.compile`` before capturing it: inductor
            fuses their small kernels (norms, rotary, router, sampling) (None: on with graphs;
            falls back to the plain step if compilation fails).
        span_bucket: with CUDA graphs, the attended cache span is rounded up to a multiple of this
            (one graph each; not with ``decode_attention="flex"``); eager steps attend exactly the written positions.
        sync_every: decode steps between reads of the ``done`` flags (refill granularity).
        eos_token_id: the id that ends a response (None: the tokenizer's, else the model config's;
            an id never drawn, e.g. -1, turns EOS off).
        share_prompts: prefill identical prompts of one refill once and fork their K/V (groups).
        kv_cache: "static" (a ``[B, Hkv, S, D]`` slot per sequence) or "paged" (a block pool used as
            sequences grow, shared prompt blocks, preemption when it runs out; see
            :mod:`streamrl.engines.paged_kv`).
        block_size: positions per block of the paged cache (``span_bucket`` must be a multiple).
        kv_blocks: blocks of the paged pool (None: as many positions as the static cache).
        paged_attention: how the paged decode step reads the pool: "gather" (each slot's blocks
            copied into a contiguous ``[B, Hkv, span, D]`` per layer, then SDPA) or "flex"
            (FlexAttention over the pool in place, always compiled; :mod:`streamrl.engines.paged_flex`;
            CPU only: refused on CUDA, where it fails its parity test).
        decode_attention: how the static cache's decode step attends: "sdpa" (the span bucket of all
            rows) or "flex" (FlexAttention's split-KV decoding kernel over each row's own 128-position
            blocks of the whole cache; one graph for every span); "auto": flex on CUDA for caches of at least
            :data:`FLEX_MIN_LEN` positions (H200, batch 256, 1k tokens: 4.39 vs 5.49 ms a step), sdpa for
            shorter ones (the measured SmolLM2 recipe, 256 positions) and on CPU (the uncompiled step).
        experts_implementation: ``config._experts_implementation`` used inside the engine; "auto":
            :data:`~streamrl.engines.dense_experts.DENSE` on CUDA in bf16/fp16 (dense decode steps, measured
            on the H200: 4.04 vs 5.07 ms a batch-256 step; prefills through ``grouped_mm``) and on CPU, where
            it runs dense only while the FLOPs it adds stay small (``DENSE_CPU_MAX_EXTRA_FLOP``, with the
            measurement; larger experts go through ``grouped_mm``); ``batched_mm`` on CUDA in fp32 (torch's grouped GEMM
            is bf16-only there and its fallback syncs; dense fp32 is not measured); None: the model's own.
    """

    device: str = "cpu"
    batch_size: int = 64
    max_seq_len: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    record_routing: bool = False
    cuda_graphs: bool | None = None
    compile: bool | None = None
    span_bucket: int = 128
    sync_every: int = 8
    eos_token_id: int | None = None
    share_prompts: bool = True
    kv_cache: str = "static"
    block_size: int = 16
    kv_blocks: int | None = None
    paged_attention: str = "gather"
    decode_attention: str = "auto"
    experts_implementation: str | None = "auto"

    def __post_init__(self):
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache = {self.kv_cache!r}: must be one of {KV_CACHES}")
        static = self.kv_cache == "static"
        for name, ok in (("batch_size", self.batch_size > 0), ("top_k", self.top_k >= 0),
                         ("top_p", 0.0 < self.top_p <= 1.0), ("span_bucket", self.span_bucket > 0),
                         ("sync_every", self.sync_every > 0), ("block_size", self.block_size > 0),
                         ("span_bucket", static or self.span_bucket % self.block_size == 0),
                         ("paged_attention", self.paged_attention == "gather" or (
                             self.paged_attention == "flex" and not static)),
                         ("decode_attention", self.decode_attention in DECODE_ATTENTIONS and (
                             self.decode_attention != "flex" or static))):
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r} is out of range")
        if self.paged_attention == "flex" and self.on_cuda:
            # refused until it passes tests/test_hf_fast_paged.py on CUDA: an error instead of wrong tokens
            raise ValueError("paged_attention = 'flex' failed its CUDA parity test: use 'gather' on CUDA")

    @property
    def on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")
