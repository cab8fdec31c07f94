"""Attention over packed rows that skips what the row's mask hides: FlexAttention block masks.

Why: a packed micro-batch row (:mod:`streamrl.learner.packing`) holds many sequences, or a
group's prompt and its samples. With sdpa, the row's mask is a dense ``[1, 1, N, N]`` tensor
(transformers builds it from the restarting position ids, packing builds it for shared
prompts) and the kernel computes all ``N^2`` scores: a 32k-token row of 1k-token sequences
is 97 % masked. FlexAttention takes a ``BlockMask`` instead: per 128 x 128 tile whether it is
empty, full or partial, so empty tiles are never computed, and the mask itself is two ``[N]``
id vectors plus the tile table.

The rule is the one of the dense mask: query ``q`` sees key ``k`` iff ``k <= q``, both lie in
the same *unit* (a sequence, or a group sharing its prompt) and ``k`` is in the unit's shared
prompt (segment ``-1``) or in ``q``'s own segment.

The model runs with the attention implementation :data:`PACKED_ATTENTION`: FlexAttention when
the mask it gets is a ``BlockMask``, transformers' sdpa otherwise (padded evaluation, the
padded reference step), so one model serves both. FlexAttention's backward needs a GPU (torch
refuses it on CPU); on CPU its forward runs unfused, which the tests use to check the masks.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PACKED_ATTENTION = "streamrl_packed"
"""Name under which :func:`packed_attention_forward` is registered with transformers."""

ATTENTION_CHOICES = ("auto", "sdpa", "flex", "segments")


def resolve_attention(setting: str, device_type: str) -> str:
    """``learner.attention`` -> ``"flex"``, ``"sdpa"`` or ``"segments"`` (``auto``: flex on CUDA,
    segments on CPU, :mod:`streamrl.learner.segment_attention`)."""
    if setting not in ATTENTION_CHOICES:
        raise ValueError(f"learner.attention = {setting!r}: must be one of {ATTENTION_CHOICES}")
    if setting == "auto":
        return "flex" if device_type == "cuda" else "segments"
    return setting


# FlexAttention's Triton tile knobs (torch's ``FlexKernelOptions``); each may carry a ``fwd_`` or
# ``bwd_`` prefix to apply to one pass only. Empty: torch's own choice per shape and GPU.
FLEX_OPTION_NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps",
                     "num_stages", "ROWS_GUARANTEED_SAFE", "WRITE_DQ", "USE_TMA")
_flex_kernel_options: dict[str, int | bool] = {}


def parse_flex_options(spec: str) -> dict[str, int | bool]:
    """``"fwd_BLOCK_M=64,fwd_BLOCK_N=128,bwd_BLOCK_M1=64"`` -> the ``kernel_options`` dict.

    Values are ints or ``true``/``false``; names are :data:`FLEX_OPTION_NAMES`, optionally
    prefixed ``fwd_``/``bwd_``. Raises ValueError naming the first bad item.
    """
    out: dict[str, int | bool] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, value = item.partition("=")
        base = name.removeprefix("fwd_").removeprefix("bwd_")
        if not eq or base not in FLEX_OPTION_NAMES:
            raise ValueError(f"flex kernel option {item!r}: expected NAME=VALUE with NAME one of {FLEX_OPTION_NAMES}, "
                             "optionally prefixed fwd_ or bwd_")
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
        elif value.isdigit() and int(value) > 0:
            out[name] = int(value)
        else:
            raise ValueError(f"flex kernel option {item!r}: the value must be a positive integer, true or false")
    return out


def set_flex_kernel_options(options: dict[str, int | bool]) -> None:
    """Use ``options`` as FlexAttention's ``kernel_options`` from now on (the learner bench's
    ``--flex-options`` sweep). Set it before the first compiled forward: compiled layers bake
    the options into their kernels."""
    _flex_kernel_options.clear()
    _flex_kernel_options.update(options)


@functools.cache
def _compiled_flex():
    """FlexAttention compiled once per process (the fused kernel; eager runs the dense math)."""
    return torch.compile(flex_attention)


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function: query [B, Hq, N, D], key/value [B, Hkv, N, D] ->
    ([B, N, Hq, D], None). FlexAttention for a ``BlockMask``, sdpa for anything else."""
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout > 0 and module.training:
        raise ValueError("learner.attention = flex: the model has attention dropout, which FlexAttention lacks; "
                         "use learner.attention = sdpa")
    # inside a compiled layer (learner.compile) dynamo traces flex_attention itself
    flex = _eager_flex() if torch.compiler.is_compiling() or not query.is_cuda else _compiled_flex()
    out = flex(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
               kernel_options=dict(_flex_kernel_options) or None)
    return out.transpose(1, 2).contiguous(), None


def _eager_flex():
    return flex_attention


@functools.cache
def register_attention(name: str, forward, mask_builder=None) -> str:
    """Register ``forward`` as attention ``name`` with transformers, with ``mask_builder`` (default:
    sdpa's, which the padded path needs: evaluation, the padded reference) as the mask function
    transformers calls before the forward; idempotent. Returns the name."""
    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_builder or sdpa_mask)
    return name


def use_packed_attention(model: nn.Module) -> None:
    """Switch ``model`` (a transformers model, sharded or not) to :data:`PACKED_ATTENTION`."""
    model.set_attn_implementation(register_attention(PACKED_ATTENTION, packed_attention_forward))


def packed_block_mask(segment_ids: torch.Tensor, unit_ids: torch.Tensor, block_size: int = 128):
    """The ``BlockMask`` of one packed row (see the module docstring for the rule).

    Built from per-tile summaries, not by evaluating the rule on all ``N^2`` pairs as torch's
    ``create_block_mask`` does: a packed row's samples and units are contiguous runs of tokens,
    so each ``block_size`` tile is described by its position range, unit range, segment range and
    whether it holds prompt tokens, and a ``[N/128, N/128]`` comparison of those ranges says which
    tiles can hold a visible pair (computed) and which are all-visible (no mask applied). Why not
    ``create_block_mask``: eager it materializes the dense mask (11 s for a 33k-token row on 2 CPU
    cores), and compiled it costs a dynamo trace per process and another at the first row of a
    new length, which the learner's first step pays (``tools/gpu/warmup_time.py``). The
    range test is exact for contiguous runs, which packing makes (``tests/test_flex_attention.py``
    compares every tile with the dense mask); for any other layout it can only mark more tiles
    computed, never fewer, and the ``mask_mod`` keeps the result exact.

    Args:
        segment_ids: [N] int64, the sample each token belongs to, -1 on a unit's shared prompt.
        unit_ids: [N] int64, the unit (sequence, or group sharing a prompt) of each token.
    Returns:
        a ``BlockMask`` of shape [1, 1, N, N] on the ids' device.
    """
    n = int(segment_ids.shape[0])
    tiles = -(-n // block_size)
    pad = tiles * block_size - n
    big = torch.iinfo(torch.int64).max
    valid = torch.arange(tiles * block_size, device=segment_ids.device).view(tiles, block_size) < n
    seg = nn.functional.pad(segment_ids, (0, pad)).view(tiles, block_size)
    unit = nn.functional.pad(unit_ids, (0, pad)).view(tiles, block_size)
    prompt, resp = valid & (seg < 0), valid & (seg >= 0)
    has_prompt, has_resp, complete = prompt.any(1), resp.any(1), valid.all(1)
    unit_lo, unit_hi = unit.masked_fill(~valid, big).amin(1), unit.masked_fill(~valid, -big).amax(1)
    seg_lo, seg_hi = seg.masked_fill(~resp, big).amin(1), seg.masked_fill(~resp, -big).amax(1)
    # [q tile, k tile] pairs; k <= q tile-wise: some pair causal (k tile not after q tile), every pair causal
    # (k tile strictly before q tile)
    idx = torch.arange(tiles, device=segment_ids.device)
    some_causal, all_causal = idx[None, :] <= idx[:, None], idx[None, :] < idx[:, None]
    some_unit = (unit_lo[None, :] <= unit_hi[:, None]) & (unit_lo[:, None] <= unit_hi[None, :])
    some_segment = (has_resp[:, None] & has_resp[None, :] & (seg_lo[None, :] <= seg_hi[:, None])
                    & (seg_lo[:, None] <= seg_hi[None, :]))
    computed = some_causal & some_unit & (has_prompt[None, :] | some_segment)
    one_unit = complete & (unit_lo == unit_hi)
    one_segment = seg_lo == seg_hi  # the tile's response tokens (at least one) are one sample's
    # a full pair: one unit on both sides, and the keys are prompt tokens, or prompt tokens and the
    # response tokens of the queries' one sample (no query on the prompt, which sees no response)
    full = (all_causal & one_unit[:, None] & one_unit[None, :] & (unit_lo[:, None] == unit_lo[None, :])
            & (~has_resp[None, :] | ((~has_prompt & one_segment)[:, None] & one_segment[None, :]
                                     & (seg_lo[:, None] == seg_lo[None, :]))))
    partial = computed & ~full

    def table(tiles_of: torch.Tensor):  # [Q, K] bool -> ([1, 1, Q] counts, [1, 1, Q, K] indices, listed first)
        order = torch.argsort(tiles_of.to(torch.int8), dim=-1, descending=True, stable=True)
        return tiles_of.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    def visible(b, h, q, k):
        return (k <= q) & (unit_ids[q] == unit_ids[k]) & ((segment_ids[k] < 0) | (segment_ids[q] == segment_ids[k]))

    return BlockMask.from_kv_blocks(*table(partial), *table(full), BLOCK_SIZE=block_size, mask_mod=visible,
                                    seq_lengths=(n, n))


def dense_packed_mask(segment_ids: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """The same rule as a dense ``[1, 1, N, N]`` bool mask (the sdpa path's shared-prompt mask)."""
    n = segment_ids.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril()
    same_unit = unit_ids[:, None] == unit_ids[None, :]
    visible = (segment_ids[None, :] < 0) | (segment_ids[:, None] == segment_ids[None, :])
    return (causal & same_unit & visible)[None, None]
