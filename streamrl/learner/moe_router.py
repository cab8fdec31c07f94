"""Router stability for MoE RL: warm-up freeze, health metrics that gate unfreezing, router EMA.

Why: early RL updates on a freshly loaded (or upcycled) MoE can collapse routing onto a few
experts; and the rollout engine's routing drifts from the learner's when the router moves
fast, which raises the train/inference mismatch. So:

* **freeze** the router weights for the first ``router_freeze_steps`` steps (their gradient is
  dropped before the optimizer, so AdamW neither moves nor decays them), and keep them frozen
  until the routing is healthy: mean ``moe/router_entropy`` >= ``router_unfreeze_min_entropy``
  and mean ``moe/expert_usage_std`` <= ``router_unfreeze_max_usage_std`` (0 = no gate);
* keep an **EMA** of the router weights (decay ``router_ema``); :meth:`ema_state` gives
  ``{param_name: full tensor}`` that the publisher sends instead of the raw router, so rollouts
  route with a smoothed router;
* per-layer **metrics** over the real (non-pad) tokens of all data-parallel ranks.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from streamrl.config import LearnerConfig


def router_metrics(router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor | None = None,
                   group=None, as_tensors: bool = False) -> dict[str, float] | dict[str, torch.Tensor]:
    """Per-layer ``moe/router_entropy/layer{i}`` and ``moe/expert_usage_std/layer{i}`` plus means.

    ``as_tensors``: 0-dim float64 device tensors (the training loop reads them once per step)
    instead of floats (which wait for the device).

    Entropy is of the routing softmax, normalised by log E (1 = uniform). Usage std is the std
    of the fraction of top-k assignments per expert, times E (0 = perfectly balanced).

    Args:
        router_logits: per layer [N, E]; token_mask: [N] (1 = real token) or None.
        group: all-reduce the statistics over this group (every rank gets the same numbers).
    """
    if not router_logits:
        return {}
    n_layers, e = len(router_logits), router_logits[0].shape[-1]
    dev = router_logits[0].device
    m = torch.ones(router_logits[0].shape[0], device=dev) if token_mask is None else token_mask.reshape(-1).float().to(dev)
    stats = torch.zeros(n_layers, e + 2, device=dev, dtype=torch.float64)
    with torch.no_grad():
        for i, logits in enumerate(router_logits):
            p = logits.detach().float().softmax(-1)
            ent = -(p * p.clamp_min(1e-12).log()).sum(-1)
            chosen = logits.detach().topk(top_k, dim=-1).indices
            stats[i, :e] = torch.zeros(e, device=dev).scatter_add_(0, chosen.reshape(-1), m.repeat_interleave(top_k)).double()
            stats[i, e] = (ent * m).sum().double()
            stats[i, e + 1] = m.sum().double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    usage = stats[:, :e] / stats[:, :e].sum(-1, keepdim=True).clamp(min=1)
    ents = stats[:, e] / stats[:, e + 1].clamp(min=1) / math.log(e)  # [L]
    stds = usage.std(-1) * e  # [L]
    out = {}
    for i in range(n_layers):
        out[f"moe/router_entropy/layer{i}"], out[f"moe/expert_usage_std/layer{i}"] = ents[i], stds[i]
    out["moe/router_entropy"] = ents.sum() / n_layers
    out["moe/expert_usage_std"] = stds.sum() / n_layers
    if as_tensors:
        return out
    return dict(zip(out, torch.stack(list(out.values())).tolist()))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class RouterController:
    """Freeze / unfreeze and EMA of the router weights of the given MoE blocks."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], cfg: LearnerConfig):
        ids = {id(b.gate.weight) for b in blocks}
        self.params: list[tuple[str, nn.Parameter]] = [(n, p) for n, p in model.named_parameters() if id(p) in ids]
        self.cfg = cfg
        self.frozen = bool(self.params) and cfg.router_freeze_steps > 0
        self.ema: dict[str, torch.Tensor] = {}
        if cfg.router_ema > 0:
            self.ema = {n: _local(p.data).detach().clone().float() for n, p in self.params}

    def update_freeze(self, step: int, metrics: dict[str, float]) -> bool:
        """Decide (identically on every rank: metrics are all-reduced) whether routers train now."""
        if not self.frozen:
            return False
        c = self.cfg
        healthy = step >= c.router_freeze_steps
        if c.router_unfreeze_min_entropy > 0 and "moe/router_entropy" in metrics:
            healthy &= metrics["moe/router_entropy"] >= c.router_unfreeze_min_entropy
        if c.router_unfreeze_max_usage_std > 0 and "moe/expert_usage_std" in metrics:
            healthy &= metrics["moe/expert_usage_std"] <= c.router_unfreeze_max_usage_std
        if healthy:
            self.frozen = False
        return self.frozen

    def drop_grads(self) -> None:
        """While frozen: no gradient, so the optimizer skips the routers entirely."""
        if self.frozen:
            for _, p in self.params:
                p.grad = None

    @torch.no_grad()
    def update_ema(self) -> None:
        d = self.cfg.router_ema
        for n, p in self.params:
            self.ema[n].mul_(d).add_(_local(p.data).float(), alpha=1 - d)

    def ema_state(self) -> dict[str, torch.Tensor]:
        """``{param_name: full EMA tensor}`` in the parameter's dtype (a collective when sharded)."""
        out = {}
        for n, p in self.params:
            t = self.ema[n].to(p.dtype)
            if hasattr(p.data, "full_tensor"):
                t = DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            out[n] = t
        return out
