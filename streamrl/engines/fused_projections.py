"""One GEMM for the q/k/v projections and one for a dense MLP's gate/up, in the decode engine's model.

A decode step runs every projection on ``B`` rows, one token per slot: GEMMs of a few MB of
weights that take a few microseconds each, so a step's time follows its kernel count more than
its bytes (the SmolLM2 shape decodes 128 slots in 3.25 ms on an H100, ~110 us per layer, where its
7 MB of weights take ~2 us to read). Attention reads one input three times (q, k, v) and a gated MLP twice
(gate, up): one GEMM over the projections' weights stacked row-wise gives the same products with
two kernels fewer per attention and one fewer per MLP (90 of a 30-layer dense model's step).

How: :func:`fuse_projections` copies each such group's weights once into one buffer
``[sum of out_features, in_features]`` and makes every projection's parameter a row block of it
(its ``.data`` swapped for a view: the same Parameter objects, names, shapes and values, no extra
memory once the old storage is freed). Version loads (``_foreach_copy_``) and adapter merges write
through the views, and CUDA graphs read the buffer by address. The module's class is swapped for a
subclass whose ``forward`` runs one ``F.linear`` over the buffer and splits its output, then does what
the family's own forward does (per-head q/k norms, rotary, cache, attention kernel, ``o_proj``;
``down_proj(act(gate) * up)``). Only the families whose forward is reproduced here are fused
(:data:`ATTENTION_FAMILIES`, :data:`MLP_FAMILIES`); any other module, or a projection that is not a
plain ``nn.Linear`` (an adapter wrapper, a quantized layer), keeps its own forward.

The engine owns this model: it must not be moved or cast afterwards (``.to()`` would give each
parameter new storage and leave the buffer behind).

The outputs are the unfused ones up to float rounding (a GEMM over the stacked weights may sum
in another order than three separate ones). The engine fuses on CUDA only: a CPU decode step is
bound by its FLOPs, not its op count, and fused it was no faster (SmolLM2-135M, 64 rows, 24 new
tokens, one thread: 8.61 s vs 8.32 s a batch, median of 7 alternated runs).
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def _config_window(module: nn.Module) -> int | None:
    return getattr(module.config, "sliding_window", None)


def _module_window(module: nn.Module) -> int | None:
    return module.sliding_window


ATTENTION_FAMILIES: dict[str, Callable[[nn.Module], int | None] | None] = {
    "LlamaAttention": None,
    "MistralAttention": _config_window,
    "MixtralAttention": _config_window,
    "Qwen2Attention": _module_window,
    "Qwen2MoeAttention": None,
    "Qwen3Attention": _module_window,
    "Qwen3MoeAttention": _module_window,
}
"""Attention classes fused (transformers 5.19), each with where its forward takes the
``sliding_window`` it passes to the attention kernel (None: it passes none)."""

MLP_FAMILIES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP"})
"""Gated MLP classes fused: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


def _stack(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [sum out, in], bias [sum out] or None)`` holding the layers' values; each layer's
    parameters become row blocks of them."""
    sizes = [lin.out_features for lin in linears]
    weight = torch.cat([lin.weight.detach() for lin in linears])
    for lin, block in zip(linears, weight.split(sizes)):
        lin.weight.data = block
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears])
        for lin, block in zip(linears, bias.split(sizes)):
            lin.bias.data = block
    return weight, bias


def _stackable(linears: list[nn.Module]) -> bool:
    """Plain linears of one dtype and device, contiguous weights, all with a bias or none."""
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    w0 = linears[0].weight
    return (all(lin.weight.is_contiguous() and lin.weight.dtype == w0.dtype and lin.weight.device == w0.device
                for lin in linears)
            and len({lin.bias is None for lin in linears}) == 1)


def _qkv_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                 **kwargs):
    """The family's attention forward with one GEMM for q/k/v: hidden_states ``[B, T, H]`` ->
    ``([B, T, H], attention weights or None)``."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = F.linear(hidden_states, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, -1)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm per head, before the rotation
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = self.rotate(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager_attention)
    window = {} if self.window is None else {"sliding_window": self.window(self)}
    dropout = 0.0 if not self.training else self.attention_dropout
    out, weights = attention(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _gate_up_forward(self, x):
    """``down_proj(act_fn(gate) * up)`` with one GEMM for gate and up: x ``[..., H]`` -> ``[..., H]``."""
    gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, -1)
    return self.down_proj(self.act_fn(gate) * up)


_fused_classes: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """The subclass of ``cls`` with the fused forward (one per class, so compiled layers share it)."""
    if cls not in _fused_classes:
        if cls.__name__ in ATTENTION_FAMILIES:
            family = sys.modules[cls.__module__]  # the family's own rotary and eager kernel
            window = ATTENTION_FAMILIES[cls.__name__]
            body = {"forward": _qkv_forward, "window": None if window is None else staticmethod(window),
                    "rotate": staticmethod(family.apply_rotary_pos_emb),
                    "eager_attention": staticmethod(family.eager_attention_forward)}
        else:
            body = {"forward": _gate_up_forward}
        _fused_classes[cls] = type(f"Fused{cls.__name__}", (cls,), body)
    return _fused_classes[cls]


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v of every attention and gate/up of every gated MLP of the families above, in place
    (see the module docstring). Returns the number of modules fused; a second call fuses none."""
    fused = 0
    for module in model.modules():
        name = type(module).__name__
        if name in ATTENTION_FAMILIES:
            group = [module.q_proj, module.k_proj, module.v_proj]
        elif name in MLP_FAMILIES:
            group = [module.gate_proj, module.up_proj]
        else:
            continue
        if not _stackable(group):
            continue
        weight, bias = _stack(group)
        if name in ATTENTION_FAMILIES:
            module.qkv_weight, module.qkv_bias = weight, bias
            module.qkv_sizes = tuple(lin.out_features for lin in group)
        else:
            module.gate_up_weight, module.gate_up_bias = weight, bias
        module.__class__ = _fused_class(type(module))
        fused += 1
    return fused
