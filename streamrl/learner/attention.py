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
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function: query [B, Hq, N, D], key/value [B, Hkv, N, D] ->
    ([B, N, Hq, D], None). FlexAttention for a ``BlockMask``, sdpa for anything else."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.cache
def register_attention(name: str, forward, mask_builder=None) -> str:
    """Register ``forward`` as attention ``name`` with transformers, with ``mask_builder`` (default:
    sdpa's, which the padded path needs: evaluation, the padded reference) as the mask function
    transformers calls before the forward; idempotent. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_builder or sdpa_mask)
    return name


def use_packed_attention(model: nn.Module) -> None:
    """Switch ``model`` (a transformers model, sharded or not) to :data:`PACKED_ATTENTION`."""
    model.set_attn_implementation(register_attention(PACKED_ATTENTION, packed_attention_forward))


def packed_block_mask(segment_ids: torch.Tensor, unit_ids: torch.Tensor):
    """The ``BlockMask`` of one packed row (see the module docstring for the rule).

    Args:
        segment_ids: [N] int64, the sample each token belongs to, -1 on a unit's shared prompt.
        unit_ids: [N] int64, the unit (sequence, or group sharing a prompt) of each token.
    Returns:
        a ``BlockMask`` of shape [1, 1, N, N] on the ids' device (built compiled on CUDA).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    n = int(segment_ids.shape[0])

    def visible(b, h, q, k):
        return (k <= q) & (unit_ids[q] == unit_ids[k]) & ((segment_ids[k] < 0) | (segment_ids[q] == segment_ids[k]))

    return create_block_mask(visible, 1, None, n, n, device=segment_ids.device, _compile=segment_ids.is_cuda)


def dense_packed_mask(segment_ids: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """The same rule as a dense ``[1, 1, N, N]`` bool mask (the sdpa path's shared-prompt mask)."""
    n = segment_ids.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=segment_ids.device).tril()
    same_unit = unit_ids[:, None] == unit_ids[None, :]
    visible = (segment_ids[None, :] < 0) | (segment_ids[:, None] == segment_ids[None, :])
    return (causal & same_unit & visible)[None, None]
