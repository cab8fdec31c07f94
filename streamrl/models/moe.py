"""An expert-parallel MoE block that replaces the transformers sparse-MoE block in place.

Why our own block: the learner needs things the HF block does not do: experts sharded across
an ``ep`` process group with differentiable all-to-all token dispatch and combine, grouped
GEMM for the local experts, routing replay (R3) from the rollout's routed expert ids, router
logits kept for the aux / z losses, and deterministic routing in eval mode.

Parameter names stay those of transformers (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I], Qwen2-MoE's ``mlp.shared_expert*``,
DeepSeek's ``mlp.shared_experts.*`` and ``mlp.gate.e_score_correction_bias``), so HF
checkpoints, the weights publisher and vLLM see the same names; only the expert tensors hold
the ``E / ep`` local experts of this rank. Which families convert, and with which routing, is
declared in :mod:`streamrl.models.families`; the rest are refused by :func:`convert_moe_blocks`.

Dispatch per layer, for N tokens and top-k (S = N k assignments)::

    sort assignments by expert ─► [ep > 1] all-to-all (tokens to the rank owning the expert)
    ─► regroup by local expert ─► grouped MLP ─► undo ─► [ep > 1] all-to-all back ─► weighted sum
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from streamrl.errors import ConfigError
from streamrl.models.families import MoEFamily, RoutingSpec, moe_family

# Names of the routed-expert tensors (transformers' and EPMoEBlock's alike): the ones expert
# parallelism shards over ep ranks.
EXPERT_PARAM_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")


def is_expert_param(name: str) -> bool:
    """True for the (ep-sharded) routed-expert tensors."""
    return name.endswith(EXPERT_PARAM_SUFFIXES)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` (see :class:`LocalExperts`)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class _GatherRows(torch.autograd.Function):
    """``x[src // k]`` for a permutation ``src`` of the S = N k (token, slot) rows, without atomics.

    Autograd's backward of ``index_select`` is an ``index_add``: a scatter, atomic on the GPU and,
    with k copies of every token, contended (a bf16 ``index_add`` there takes 12 % of the 1.31 B MoE
    step on an H200). ``src`` here is a permutation, so the gradient is a gather by its inverse
    ``inv`` ([S] int64), then a sum over each token's k copies: x [N, H] -> [S, H].
    """

    @staticmethod
    def forward(ctx, x, src, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, src // k if k > 1 else src)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        gx = g.index_select(0, inv)
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, g.shape[-1]).sum(1)
        return gx, None, None, None


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv [S] with inv[perm[i]] = i: a scatter to distinct rows (no atomics), cheaper than a sort."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def route(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    replay: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing (Qwen3-MoE, Mixtral, OLMoE); see :func:`route_spec`."""
    return route_spec(logits, RoutingSpec(top_k, norm_topk_prob), replay, deterministic)


def _top(x: torch.Tensor, k: int, deterministic: bool) -> torch.Tensor:
    """Indices of the k largest entries of the last dim; ties to the lower index when deterministic."""
    if deterministic:
        return torch.argsort(x, dim=-1, descending=True, stable=True)[..., :k]
    return torch.topk(x, k, dim=-1).indices


def route_spec(
    logits: torch.Tensor,
    spec: RoutingSpec,
    replay: torch.Tensor | None = None,
    deterministic: bool = False,
    choice_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A family's top-k routing, optionally replaying given expert ids (R3).

    Args:
        logits: [N, E] router logits.
        spec: the family's routing (score function, groups, normalisation, scaling).
        replay: [N, k] int expert ids to use instead of the top-k, -1 where a row is not
            replayed (the whole row falls back to the router's own choice).
        deterministic: break ties by the lower expert (group) id (a stable sort), so
            evaluation routing does not depend on the kernel's tie order.
        choice_bias: [E] added to the scores for the choice only (DeepSeek-V3's
            ``e_score_correction_bias``), or None.
    Returns:
        (weights [N, k] float32, expert ids [N, k] int64).
    """
    logits = logits.float()
    scores = torch.sigmoid(logits) if spec.score == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if choice_bias is None else scores + choice_bias.float()
    if spec.n_group > 1:
        n, e = choice.shape
        grouped = choice.view(n, spec.n_group, e // spec.n_group)
        g_score = grouped.topk(2, dim=-1).values.sum(-1) if spec.group_score == "top2_sum" else grouped.amax(-1)
        keep = torch.zeros_like(g_score, dtype=torch.bool)
        keep.scatter_(1, _top(g_score, spec.topk_group, deterministic), True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // spec.n_group, dim=1), float("-inf"))
    idx = _top(choice, spec.top_k, deterministic)
    if replay is not None:
        replay = replay.to(device=idx.device, dtype=torch.int64)
        use = (replay >= 0).all(-1, keepdim=True)
        idx = torch.where(use, replay.clamp(min=0), idx)
    w = scores.gather(-1, idx)
    if spec.norm_topk_prob:
        # DeepSeek-V3 adds 1e-20 (sigmoid weights can all be ~0); softmax weights never are
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if spec.score == "sigmoid" else 0.0))
    return w * spec.scaling if spec.scaling != 1.0 else w, idx


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
        x = x.to(gu.dtype)  # a no-op unless FSDP's param_dtype differs from the activations
        # grouped_mm on CPU too when asked for explicitly (``auto`` picks the loop there): it
        # needs 16-byte-aligned rows, and it is how the CPU tests compile the GPU's layer graph
        if self.impl == "grouped_mm":
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

    def __init__(self, hf_block: nn.Module, routing: RoutingSpec, ep_rank: int = 0, ep_size: int = 1,
                 ep_group=None, impl: str = "loop", shared: tuple[str, ...] = ()):
        super().__init__()
        experts = hf_block.experts
        self.num_experts = experts.gate_up_proj.shape[0]
        if self.num_experts % ep_size:
            raise ValueError(f"num_experts = {self.num_experts} is not divisible by ep = {ep_size}")
        self.routing = routing
        self.top_k = routing.top_k
        self.ep_rank, self.ep_size, self.ep_group = ep_rank, ep_size, ep_group
        self.n_local = self.num_experts // ep_size
        lo, hi = ep_rank * self.n_local, (ep_rank + 1) * self.n_local
        self.gate = hf_block.gate  # keeps the names mlp.gate.weight (and e_score_correction_bias)
        # ep > 1: a copy of this rank's slice, so the other ranks' experts can be freed. ep = 1:
        # the HF tensors themselves (the HF experts module goes away with this conversion), so
        # converting a model that fills most of the GPU does not need room for a second copy
        gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
        if ep_size > 1:
            gate_up, down = gate_up[lo:hi].clone(), down[lo:hi].clone()
        self.experts = LocalExperts(gate_up, down, experts.act_fn, impl)
        # Shared experts under their HF attribute names: Qwen2-MoE's shared_expert with its
        # sigmoid shared_expert_gate, DeepSeek's shared_experts (always added, no gate).
        self.shared = tuple(shared)
        for name in self.shared:
            setattr(self, name, getattr(hf_block, name))
        self.replay: torch.Tensor | None = None
        self.last_router_logits: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        r = self.routing
        logits = F.linear(x.float(), self.gate.weight.float()) if r.fp32_logits else F.linear(x, self.gate.weight)
        self.last_router_logits = logits
        bias = getattr(self.gate, "e_score_correction_bias", None) if r.choice_bias else None
        w, idx = route_spec(logits, r, self.replay, deterministic=not self.training, choice_bias=bias)
        y = self._dispatch_combine(x, idx)  # [N, k, H]
        # the fp32 routing weights rounded to the activations' dtype before the product, as the
        # HF blocks do (exactness against them); compiled, both casts fuse into the product
        out = (y * w.unsqueeze(-1).to(y.dtype)).sum(1).to(hidden.dtype)
        if "shared_expert" in self.shared:
            s = self.shared_expert(x)
            if "shared_expert_gate" in self.shared:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        if "shared_experts" in self.shared:
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    def _dispatch_combine(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Expert outputs per (token, slot): x [N, H], idx [N, k] -> [N, k, H]."""
        n, k = idx.shape
        flat = idx.reshape(-1)
        sorted_ids, order = torch.sort(flat, stable=True)
        inv_order = _inverse_permutation(order)
        x_sorted = _GatherRows.apply(x, order, inv_order, k)  # [S, H] grouped by global expert
        # Rows per expert from the sorted ids by binary search: a static [E] shape (bincount's
        # output size depends on the data, which breaks the compiled graph) and no atomics.
        edges = torch.arange(self.num_experts + 1, device=flat.device, dtype=flat.dtype)
        counts = torch.searchsorted(sorted_ids, edges).diff()
        if self.ep_size == 1:
            y_sorted = self.experts(x_sorted, counts)
        else:
            y_sorted = self._ep_exchange(x_sorted, counts)
        return _GatherRows.apply(y_sorted, inv_order, order, 1).view(n, k, -1)

    def _ep_exchange(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
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
        inv_perm = _inverse_permutation(perm)
        y_loc = self.experts(_GatherRows.apply(x_recv, perm, inv_perm, 1), recv_mat.sum(0))
        y_recv = _GatherRows.apply(y_loc, inv_perm, perm, 1)
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
    experts slice. Returns the new blocks (empty for a dense model). Raises :class:`ConfigError`
    (one line naming the family and what is unsupported) for an MoE the block does not
    reproduce exactly (see :mod:`streamrl.models.families`).
    """
    family: MoEFamily | None = moe_family(model.config)
    found = find_moe_blocks(model)
    if family is None:
        if found:
            raise ConfigError(f"model family {model.config.model_type!r}: has sparse-MoE blocks but its config "
                              "declares no experts; not converted")
        return []
    if not found:
        raise ConfigError(f"model family {family.name!r}: no fused-expert MoE blocks (mlp.gate + "
                          f"mlp.experts.gate_up_proj) found in {type(model).__name__}")
    blocks = []
    for name, mod in found:
        new = EPMoEBlock(mod, family.routing, ep_rank, ep_size, ep_group, impl, family.shared)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        blocks.append(new)
    return blocks
