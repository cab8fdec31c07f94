"""Gradient clipping across FSDP2 meshes of different shapes (dense and expert parameters)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def clip_grad_norm_on_device(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip gradients to a global L2 norm; returns the norm before clipping (0-dim float64 tensor
    on the gradients' device; nothing here waits for the device).

    Works across FSDP meshes of different shapes (dense params over all ranks, experts over
    ``dp_shard``) where ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensor meshes: every
    rank holds a disjoint shard of every gradient, so the squared norm is a sum over ranks.
    Like ``clip_grad_norm_(foreach=True)`` the scale ``min(1, max_norm / (norm + 1e-6))`` is
    applied on the device, to every gradient (a multiply by 1 below the limit, skipped on CPU
    where reading the norm costs nothing).
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not local:
        return torch.zeros((), dtype=torch.float64)
    # fp32 (fp64) accumulation inside the kernel, no fp32 copy of bf16 gradients; squares summed in fp64
    acc = torch.float64 if any(x.dtype == torch.float64 for x in local) else torch.float32
    sq = torch.stack(torch._foreach_norm([x.detach() for x in local], 2, dtype=acc)).double().pow(2).sum()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if coef.device.type == "cpu" and float(coef) >= 1.0:  # reading a CPU value waits for nothing
        return norm
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for x in local:
        by_dtype.setdefault(x.dtype, []).append(x)
    for xs in by_dtype.values():
        torch._foreach_mul_(xs, coef.to(xs[0].dtype))
    return norm
