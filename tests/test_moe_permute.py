"""MoE dispatch / combine by permutation gathers (no ``index_add`` in the backward) equals the
``index_select`` implementation it replaced: outputs and gradients of x, router and experts."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.models.factory import build_model
from streamrl.models.families import RoutingSpec
from streamrl.models.moe import EPMoEBlock, _GatherRows, _inverse_permutation

E = 4  # experts


class IndexSelectBlock(EPMoEBlock):
    """The previous dispatch / combine (autograd's ``index_select``, backward ``index_add``)."""

    def _dispatch_combine(self, x, idx):
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        x_sorted = x.index_select(0, order // k)
        y_sorted = self.experts(x_sorted, torch.bincount(flat, minlength=self.num_experts))
        return y_sorted.index_select(0, torch.argsort(order)).reshape(n, k, -1)


def _blocks(k: int, seed: int = 0):
    cfg = ModelConfig(num_experts=E, experts_per_token=k, num_layers=1)
    model, _ = build_model(cfg, seed=seed)
    hf = model.model.layers[0].mlp
    with torch.no_grad():  # spread the router so every expert gets tokens unless replay says otherwise
        hf.gate.weight.normal_(0, 1.0)
    spec = RoutingSpec(k, True)
    return EPMoEBlock(copy.deepcopy(hf), spec), IndexSelectBlock(copy.deepcopy(hf), spec), cfg.hidden_size


def _run(block, x, replay):
    block.zero_grad(set_to_none=True)
    block.replay = replay
    xi = x.clone().requires_grad_(True)
    y = block(xi)
    (y.square() * torch.linspace(0.5, 1.5, y.shape[-1])).sum().backward()
    return y.detach(), {"x": xi.grad, "router": block.gate.weight.grad,
                        "gate_up": block.experts.gate_up_proj.grad, "down": block.experts.down_proj.grad}


def _replay(n: int, k: int, kind: str):
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(2, generator=g)[:k] for _ in range(n)])  # experts 0, 1 only
    if kind == "partial":  # every third row falls back to the router's own choice
        ids[::3] = -1
    return ids.to(torch.int16)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("replay", ["none", "empty_experts", "partial"])
def test_permutation_dispatch_equals_index_select(k, replay):
    new, old, hidden = _blocks(k)
    torch.manual_seed(1)
    x = torch.randn(2, 9, hidden)
    rp = _replay(18, k, replay)
    y_new, g_new = _run(new, x, rp)
    y_old, g_old = _run(old, x, rp)
    assert torch.allclose(y_new, y_old, atol=1e-6)
    for name in g_old:
        assert torch.allclose(g_new[name], g_old[name], atol=1e-5), name
    if replay == "empty_experts":  # experts 2, 3 saw no token: zero (not missing) gradients
        assert g_new["gate_up"][2:].abs().max() == 0 and g_new["down"][2:].abs().max() == 0


def test_gather_rows_backward_is_the_inverse_gather():
    torch.manual_seed(0)
    n, k, h = 5, 3, 4
    perm = torch.randperm(n * k)
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    inv = _inverse_permutation(perm)
    assert torch.equal(perm[inv], torch.arange(n * k))
    y = _GatherRows.apply(x, perm, inv, k)
    assert torch.equal(y, x.detach()[perm // k])
    assert torch.autograd.gradcheck(lambda t: _GatherRows.apply(t, perm, inv, k), (x,))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_block_equals_eager():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    new, _, hidden = _blocks(2)
    compiled = copy.deepcopy(new)
    compiled.forward = torch.compile(compiled.forward)
    torch.manual_seed(1)
    x = torch.randn(2, 9, hidden)
    y_e, g_e = _run(new, x, None)
    y_c, g_c = _run(compiled, x, None)
    assert torch.allclose(y_e, y_c, atol=1e-5)
    for name in g_e:
        assert torch.allclose(g_e[name], g_c[name], atol=1e-5), name


class _RowScale(torch.nn.Module):
    """Experts without the CPU loop's data-dependent split (the grouped_mm path has none):
    row i times its expert's scale, so dispatch and combine still decide the result."""

    def __init__(self, n_experts: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, n_experts))

    def forward(self, x, counts):
        return x * torch.repeat_interleave(self.scale, counts, output_size=x.shape[0])[:, None]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dispatch_combine_compiles_without_graph_breaks():
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    new, old, hidden = _blocks(2)
    for b in (new, old):
        b.experts = _RowScale(E)
    new.forward = torch.compile(new.forward, fullgraph=True)  # raises on any graph break
    torch.manual_seed(1)
    x = torch.randn(2, 9, hidden)
    res = []
    for b in (old, new):
        xi = x.clone().requires_grad_(True)
        y = b(xi)
        y.square().sum().backward()
        res.append((y.detach(), xi.grad, b.experts.scale.grad, b.gate.weight.grad))
    for a, c in zip(*res):
        assert torch.allclose(a, c, atol=1e-5)
