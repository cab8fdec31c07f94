"""An expert-parallel MoE block that replaces the transformers sparse-MoE block in place.

Why our own block: the learner needs things the HF block does not do: experts sharded across
an ``ep`` process group with differentiable all-to-all token dispatch and combine, grouped
GEMM for the local experts, routing replay (R3) from the rollout's routed expert ids, router
logits kept for the aux / z losses, and deterministic routing in eval mode.

Parameter names stay those of transformers (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I], Qwen2-MoE's ``mlp.shared_expert*``), so HF
checkpoints, the weights publisher and vLLM see the same names; only the expert tensors hold
the ``E / ep`` local experts of this rank. Works for the fused-expert layout that Qwen3-MoE,
Qwen2-MoE, Mixtral and OLMoE share in transformers 5.

Dispatch per layer, for N tokens and top-k (S = N k assignments)::

    sort assignments by expert ─► [ep > 1] all-to-all (tokens to the rank owning the expert)
    ─► regroup by local expert ─► grouped MLP ─► undo ─► [ep > 1] all-to-all back ─► weighted sum
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` (see :class:`LocalExperts`)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def route(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    replay: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing, optionally replaying given expert ids (R3).

    Args:
        logits: [N, E] router logits.
        replay: [N, k] int expert ids to use instead of the top-k, -1 where a row is not
            replayed (the whole row falls back to the router's own choice).
        deterministic: break ties by the lower expert id (a stable sort), so evaluation routing
            does not depend on the kernel's tie order.
    Returns:
        (weights [N, k] float32, expert ids [N, k] int64).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    if deterministic:
        idx = torch.argsort(probs, dim=-1, descending=True, stable=True)[:, :top_k]
    else:
        idx = torch.topk(probs, top_k, dim=-1).indices
    if replay is not None:
        replay = replay.to(device=idx.device, dtype=torch.int64)
        use = (replay >= 0).all(-1, keepdim=True)
        idx = torch.where(use, replay.clamp(min=0), idx)
    w = probs.gather(-1, idx)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w, idx


class LocalExperts(nn.Module):
    """The ``E_local`` experts of this rank: SwiGLU MLPs stored as 3-D tensors.

    ``grad_scale`` multiplies the weight gradients: with expert parallelism every ep rank's
    tokens reach these weights through the all-to-all, so the gradient is a sum over the ep
    group; 1/ep turns it into the per-rank average the data-parallel reduction expects.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module, impl: str = "loop"):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)  # [E_l, 2I, H]
        self.down_proj = nn.Parameter(down)  # [E_l, H, I]
        self.act_fn = act
        self.impl = impl
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [S, H] rows grouped by local expert; counts: [E_l] rows per expert. Returns [S, H]."""
        gu, dn = self.gate_up_proj, self.down_proj
        if self.grad_scale != 1.0:
            gu, dn = _ScaleGrad.apply(gu, self.grad_scale), _ScaleGrad.apply(dn, self.grad_scale)
        x = x.to(gu.dtype)
        if self.impl == "grouped_mm" and x.is_cuda:
            gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = gmm(x, gu.transpose(-2, -1), offs=offs)
            g, u = h.chunk(2, dim=-1)
            return gmm(self.act_fn(g) * u, dn.transpose(-2, -1), offs=offs)
        outs = []
        # Every local expert is visited, also with 0 rows, so every rank's weights get a
        # gradient (possibly zero) and FSDP's gradient reduction has the same shape everywhere.
        for e, chunk in enumerate(torch.split(x, counts.tolist())):
            g, u = F.linear(chunk, gu[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(g) * u, dn[e]))
        return torch.cat(outs)


class EPMoEBlock(nn.Module):
    """Drop-in replacement for an HF sparse-MoE block with expert parallelism.

    Set ``replay`` ([N, k] or None) before a forward to replay routing; read
    ``last_router_logits`` ([N, E], with gradient) after it for the router losses and metrics.
    """

    def __init__(self, hf_block: nn.Module, top_k: int, norm_topk_prob: bool, ep_rank: int = 0,
                 ep_size: int = 1, ep_group=None, impl: str = "loop"):
        super().__init__()
        experts = hf_block.experts
        self.num_experts = experts.gate_up_proj.shape[0]
        if self.num_experts % ep_size:
            raise ValueError(f"num_experts = {self.num_experts} is not divisible by ep = {ep_size}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.ep_rank, self.ep_size, self.ep_group = ep_rank, ep_size, ep_group
        self.n_local = self.num_experts // ep_size
        lo, hi = ep_rank * self.n_local, (ep_rank + 1) * self.n_local
        self.gate = hf_block.gate  # keeps the name mlp.gate.weight
        self.experts = LocalExperts(experts.gate_up_proj.data[lo:hi].clone(),
                                    experts.down_proj.data[lo:hi].clone(), experts.act_fn, impl)
        self.shared_expert = getattr(hf_block, "shared_expert", None)
        self.shared_expert_gate = getattr(hf_block, "shared_expert_gate", None)
        self.replay: torch.Tensor | None = None
        self.last_router_logits: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits = F.linear(x, self.gate.weight)
        self.last_router_logits = logits
        w, idx = route(logits, self.top_k, self.norm_topk_prob, self.replay, deterministic=not self.training)
        y = self._dispatch_combine(x, idx)  # [N, k, H]
        out = (y * w.unsqueeze(-1).to(y.dtype)).sum(1).to(hidden.dtype)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        return out.reshape(shape)

    def _dispatch_combine(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Expert outputs per (token, slot): x [N, H], idx [N, k] -> [N, k, H]."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        inv_order = torch.argsort(order)
        x_sorted = x.index_select(0, order // k)  # [S, H] grouped by global expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.ep_size == 1:
            y_sorted = self.experts(x_sorted, counts)
        else:
            y_sorted = self._ep_exchange(x_sorted, counts)
        return y_sorted.index_select(0, inv_order).reshape(n, k, -1)

    def _ep_exchange(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, el = self.ep_size, self.n_local
        # Every rank learns how many rows it gets from each source for each of its experts.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send_split = counts.view(ep, el).sum(1).tolist()
        recv_mat = recv_counts.view(ep, el)  # [src, local expert]
        recv_split = recv_mat.sum(1).tolist()
        x_recv = all_to_all_single_autograd(x_sorted, recv_split, send_split, self.ep_group)
        # Rows arrive source-major; the grouped MLP wants them expert-major.
        local_id = torch.repeat_interleave(torch.arange(el, device=x_recv.device).repeat(ep),
                                           recv_mat.reshape(-1).to(x_recv.device))
        perm = torch.argsort(local_id, stable=True)
        y_loc = self.experts(x_recv.index_select(0, perm), recv_mat.sum(0))
        y_recv = y_loc.index_select(0, torch.argsort(perm))
        return all_to_all_single_autograd(y_recv, send_split, recv_split, self.ep_group)


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every HF sparse-MoE block with fused 3-D experts."""
    out = []
    for name, mod in model.named_modules():
        ex = getattr(mod, "experts", None)
        if hasattr(mod, "gate") and ex is not None and isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor):
            out.append((name, mod))
    return out


def convert_moe_blocks(model: nn.Module, ep_rank: int = 0, ep_size: int = 1, ep_group=None,
                       impl: str = "loop") -> list[EPMoEBlock]:
    """Swap every HF sparse-MoE block of ``model`` for an :class:`EPMoEBlock`, in layer order.

    Must run on the full (unsharded) model, identical on every rank; each rank keeps its own
    experts slice. Returns the new blocks (empty for a dense model).
    """
    cfg = model.config
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    # Mixtral always renormalises the top-k weights; the others say so in their config.
    norm = bool(getattr(cfg, "norm_topk_prob", True))
    blocks = []
    for name, mod in find_moe_blocks(model):
        new = EPMoEBlock(mod, top_k, norm, ep_rank, ep_size, ep_group, impl)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        blocks.append(new)
    return blocks
