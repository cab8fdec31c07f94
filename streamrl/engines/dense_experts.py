"""Dense MoE experts for decode steps: every expert runs every token, weighted by its routing.

A decode step of ``B`` sequences through an MoE layer with ``E`` experts and top-``k`` routing
is ``B * k`` (token, expert) pairs, ~``B * k / E`` rows per expert (32 for the bench's
``moe-1b`` at ``B = 256``). HF's ``grouped_mm`` implementation sorts those pairs by expert,
gathers the rows, runs two grouped GEMMs, scales, un-permutes and sums: about a dozen small
kernels per layer that each take a few microseconds on rows of this size, while the weights
the layer must read take ~6 us at the H200's bandwidth.

At decode batch sizes it is cheaper to skip the bookkeeping: one GEMM ``[B, H] x [H, E*2I]``
(all experts' gate/up projections, the parameter viewed flat, no copy), the gate, the routing
weights applied to the activations (zero for the experts a token was not routed to), and one GEMM
``[B, E*I] x [E*I, H]`` for all the down projections, which sums over the experts in its own
fp32 accumulator. That last GEMM needs ``down_proj [E, H, I]`` stored expert-minor, ``[H, E, I]``
in memory: :func:`lay_out_for_dense_decode` moves the engine's copy there once (same shape, same
values, no extra memory; the sparse path reads it through strides). Without it, a batched GEMM
wrote ``[E, B, H]`` per-expert outputs and a reduction over ``E`` read them back: on ``moe-1b`` at
``B = 256``, 32 MiB a layer each way, ~1.6 GB a step, as much traffic as all its expert weights.

Dense computes ``E / k`` times the FLOPs, which is cheap while ``B`` is small: at ``B = 256`` a
layer of ``moe-1b`` is 19 GFLOP (~30 us on an H200) and reads the same weights as the sparse path
(at this batch every expert is hit anyway). Above :data:`DENSE_MAX_TOKENS` tokens (prefills) and
on shapes it does not cover (transposed or biased expert weights, expert parallelism, a
``down_proj`` not laid out for it), it hands over to HF's sparse implementation.

On CPU the op count matters as much (each op costs microseconds of dispatch), but FLOPs are
scarce: a call runs dense only while the FLOPs it adds over the sparse path stay under
:data:`DENSE_CPU_MAX_EXTRA_FLOP` (small MoEs such as the tiny test model; a SmolLM2-sized one goes
sparse).

The result is the sparse one up to float rounding: the same products, each routed activation
scaled by its weight and rounded once to the compute dtype, and the ``k`` routed terms summed in
fp32 (the other ``E - k`` terms are exact zeros).
"""
from __future__ import annotations

import torch
from transformers.integrations.moe import (ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward,
                                           grouped_mm_experts_forward)

DENSE = "streamrl_dense_decode"
"""Name of the experts implementation registered with transformers (selected inside the engine only)."""

DENSE_MAX_TOKENS = 512
"""Tokens per call up to which every expert runs every token (decode steps); prefills go sparse."""

DENSE_CPU_MAX_EXTRA_FLOP = 8e6
"""On CPU, the most FLOPs per call the dense path may add over the sparse one, ``T (E - k) 6 H I``.
Measured on the 2-core dev machine (``python tools/dense_experts_cpu_sweep.py``: 2 layers, decode
steps of 32-64 rows; two runs): dense is 10-22 % faster per step at 1.6-9.4 MFLOP added
a layer (the tiny model's shape: 0.88 vs 1.08 ms), even at 19 MFLOP, and slower from 25 MFLOP
(1.78 vs 1.66 ms; 151 MFLOP: 4.86 vs 2.93 ms)."""


def dense_extra_flop(tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> int:
    """FLOPs the dense path adds over the sparse one in a call of ``tokens``: the ``E - k`` experts a
    token was not routed to, three ``H x I`` projections each (multiply-add = 2 FLOPs)."""
    return tokens * (experts - top_k) * 6 * hidden * inter


def _sparse(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    # torch's grouped GEMM is bf16/fp16 only on CUDA (its fp32 fallback syncs the host); on CPU it runs fp32
    fp32_cuda = hidden_states.dtype == torch.float32 and hidden_states.device.type == "cuda"
    sparse = batched_mm_experts_forward if fp32_cuda else grouped_mm_experts_forward
    return sparse(module, hidden_states, top_k_index, top_k_weights)


def lay_out_for_dense_decode(model: torch.nn.Module) -> int:
    """Store every experts module's ``down_proj [E, H, I]`` expert-minor (``[H, E, I]`` in memory), in place.

    The parameter keeps its identity, shape and values (``.data`` swapped for a permuted view), so
    loads into it (``copy_``) and HF's sparse experts work unchanged. Returns how many were moved.
    """
    moved = 0
    with torch.no_grad():
        for module in model.modules():
            down = getattr(module, "down_proj", None)
            if (isinstance(down, torch.nn.Parameter) and down.dim() == 3 and hasattr(module, "num_experts")
                    and not getattr(module, "is_transposed", False) and not _expert_minor(down)):
                down.data = down.data.permute(1, 0, 2).contiguous().permute(1, 0, 2)
                moved += 1
    return moved


def _expert_minor(down: torch.Tensor) -> bool:
    """``down [E, H, I]`` is a view of contiguous ``[H, E, I]`` storage (``down.permute(1, 0, 2)`` is contiguous)."""
    return down.permute(1, 0, 2).is_contiguous()


def dense_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """``hidden_states [T, H]``, ``top_k_index [T, k]`` (int), ``top_k_weights [T, k]`` -> ``[T, H]``.

    ``module`` is a transformers experts module (``gate_up_proj [E, 2I, H]`` or ``up_proj [E, I, H]``,
    ``down_proj [E, H, I]`` laid out by :func:`lay_out_for_dense_decode`).
    """
    t, h = hidden_states.shape
    if (t > DENSE_MAX_TOKENS or getattr(module, "is_transposed", False) or getattr(module, "has_bias", False)
            or getattr(module, "_is_expert_parallel", False) or not _expert_minor(module.down_proj)):
        return _sparse(module, hidden_states, top_k_index, top_k_weights)
    e = module.num_experts
    if hidden_states.device.type == "cpu":
        added = dense_extra_flop(t, e, top_k_index.shape[1], h, module.down_proj.shape[-1])  # down_proj [E, H, I]
        if added > DENSE_CPU_MAX_EXTRA_FLOP:
            return _sparse(module, hidden_states, top_k_index, top_k_weights)
    gated = getattr(module, "has_gate", True)
    up_w = module.gate_up_proj if gated else module.up_proj  # [E, O, H], O = 2I (gated) or I
    up = torch.nn.functional.linear(hidden_states, up_w.reshape(-1, h)).view(t, e, -1)  # [T, E, O]
    act = module._apply_gate(up) if gated else module.act_fn(up)  # [T, E, I]
    # routing weights scattered over the experts: [T, E], zero where a token was not routed
    route = torch.zeros(t, e, dtype=top_k_weights.dtype, device=hidden_states.device)
    route.scatter_(1, top_k_index, top_k_weights)
    routed = (act * route[:, :, None]).to(act.dtype).reshape(t, -1)  # [T, E*I]
    # [H, E*I]: the expert-minor storage viewed flat; the GEMM's accumulator sums over the experts
    return torch.nn.functional.linear(routed, module.down_proj.permute(1, 0, 2).reshape(h, -1))  # [T, H]


ALL_EXPERTS_FUNCTIONS.register(DENSE, dense_experts_forward)
