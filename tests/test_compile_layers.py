"""``torch.compile`` of the decoder layers (``learner.compile``): same numbers as eager, names unchanged.

Compiling on 2 CPU cores takes tens of seconds, hence ``slow``.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.models.factory import build_model
from streamrl.parallel.expert_parallel import parallelize
from streamrl.parallel.mesh import build_mesh

from tests.dist_helpers import spawn_gloo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# Compile in-process: inductor's worker pool (forked compiler processes) is what a loaded 2-core
# machine can least afford, and the gloo ranks compile at the same time.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

MCFG = ModelConfig(num_experts=4, experts_per_token=2, num_layers=2)


def _loss_and_grads(model, ids):
    out = model(input_ids=ids, use_cache=False).logits
    loss = torch.log_softmax(out.float(), -1).mean()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_layers_match_eager_and_keep_names():
    torch.manual_seed(0)
    eager, _ = build_model(MCFG, seed=0)
    compiled = copy.deepcopy(eager)
    mesh = build_mesh(1, "cpu", MCFG.num_experts)
    parallelize(eager, mesh, torch.device("cpu"))
    parallelize(compiled, mesh, torch.device("cpu"), compile_layers=True)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(0, 60, (3, 12))
    for _ in range(2):  # the second call runs the cached graphs
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
        y_e, g_e = _loss_and_grads(eager, ids)
        y_c, g_c = _loss_and_grads(compiled, ids)
        assert torch.allclose(y_e, y_c, atol=1e-5)
        assert g_e.keys() == g_c.keys()
        for n in g_e:
            assert torch.allclose(g_e[n], g_c[n], atol=1e-5), n


def _fsdp_worker(rank, world, compile_layers):
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    model, _ = build_model(MCFG, seed=0)
    mesh = build_mesh(2, "cpu", MCFG.num_experts)  # ep = 2: the all-to-all sizes break the graph
    parallelize(model, mesh, torch.device("cpu"), compile_layers=compile_layers)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 60, (2, 10), generator=g)
    out = model(input_ids=ids, use_cache=False).logits
    out.float().square().mean().backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None and ".experts." not in n}
    return {"y": out.detach(), "grads": grads}


def test_compiled_layers_under_fsdp2_and_ep2_match_eager():
    eager = spawn_gloo(_fsdp_worker, 2, False, timeout_s=300)
    compiled = spawn_gloo(_fsdp_worker, 2, True, timeout_s=300)
    for e, c in zip(eager, compiled):
        assert torch.allclose(e["y"], c["y"], atol=1e-5)
        for n in e["grads"]:
            assert torch.allclose(e["grads"][n], c["grads"][n], atol=1e-5), n


def _packed_inputs(n: int, seq: int = 20):
    """One packed row of n tokens: sequences of ``seq`` tokens, positions restarting, block-causal mask."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 60, (1, n), generator=g)
    seg = torch.arange(n) // seq
    causal = torch.arange(n)[None] <= torch.arange(n)[:, None]
    return ids, (torch.arange(n) % seq)[None], ((seg[:, None] == seg[None]) & causal)[None, None]


def test_compiled_layers_reuse_graphs_across_packed_row_lengths():
    """Packed micro-batches change length every step: the decoder layer compiles once, for
    every length (N is symbolic from the start); the pieces after the CPU expert loop's graph
    break compile twice (static, then dynamic); later lengths compile nothing. Numbers of eager."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    eager, compiled = _eager_and_compiled_packed()
    layer_code = type(compiled.model.layers[0]).forward.__code__
    layer_entries = len(_debug_get_cache_entry_list(layer_code))  # other tests may have compiled it too
    graphs = [counters["stats"]["unique_graphs"]]
    for n in (40, 56, 73, 90, 111):
        ids, pos, mask = _packed_inputs(n)
        res = []
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            out = m(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
            torch.log_softmax(out.float(), -1).mean().backward()
            res.append((out.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}))
        graphs.append(counters["stats"]["unique_graphs"])
        (y_e, g_e), (y_c, g_c) = res
        assert torch.allclose(y_e, y_c, atol=1e-5), n
        for k in g_e:
            assert torch.allclose(g_e[k], g_c[k], atol=1e-5), (n, k)
    assert len(_debug_get_cache_entry_list(layer_code)) == layer_entries + 1
    assert graphs[-1] == graphs[2], graphs  # nothing compiled for the lengths after the second


def test_compiled_layers_with_flex_block_masks_compile_at_most_twice():
    """The GPU path: a FlexAttention ``BlockMask`` per packed row (its sequence lengths are ints,
    so the first graph specialises N; the second is symbolic). Forward only: FlexAttention has
    no backward on the CPU."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from streamrl.learner.attention import packed_block_mask

    eager, compiled = _eager_and_compiled_packed()
    layer_code = type(compiled.model.layers[0]).forward.__code__
    layer_entries = len(_debug_get_cache_entry_list(layer_code))
    for n in (200, 300, 450, 520):
        ids, pos, _ = _packed_inputs(n, seq=100)
        seg = torch.arange(n) // 100
        with torch.no_grad():
            y_e, y_c = (m(input_ids=ids, position_ids=pos, attention_mask=packed_block_mask(seg, seg),
                          use_cache=False).logits for m in (eager, compiled))
        assert torch.allclose(y_e, y_c, atol=1e-5), n
    assert len(_debug_get_cache_entry_list(layer_code)) <= layer_entries + 2


def test_decoder_layer_with_grouped_mm_experts_compiles_as_one_graph():
    """The GPU's layer (grouped_mm experts, searchsorted counts, no host sync) has no graph
    break: every decoder layer compiles with ``fullgraph=True``, same numbers as eager. In bf16,
    as on the GPU: grouped_mm's shape function (what dynamo traces with) takes bf16 only."""
    eager, _ = build_model(MCFG, seed=0)
    eager.to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    mesh = build_mesh(1, "cpu", MCFG.num_experts)
    for m in (eager, compiled):
        parallelize(m, mesh, torch.device("cpu"), experts_impl="grouped_mm")
    for layer in compiled.model.layers:
        layer.forward = torch.compile(layer.forward, fullgraph=True)  # raises on any graph break
    ids = torch.randint(0, 60, (1, 24))
    y_e, g_e = _loss_and_grads(eager, ids)
    y_c, g_c = _loss_and_grads(compiled, ids)
    # bf16: inductor fuses the norms' and activations' roundings differently; a few bf16 ulps
    torch.testing.assert_close(y_c.float(), y_e.float(), atol=3e-2, rtol=3e-2)
    assert g_e.keys() == g_c.keys()
    for n in g_e:
        torch.testing.assert_close(g_c[n].float(), g_e[n].float(), atol=3e-2, rtol=5e-2, msg=n)


def _eager_and_compiled_packed():
    """The same random MoE twice on one CPU rank, packed-row attention, the second with compiled layers."""
    from streamrl.learner.attention import use_packed_attention

    eager, _ = build_model(MCFG, seed=0)
    compiled = copy.deepcopy(eager)
    mesh = build_mesh(1, "cpu", MCFG.num_experts)
    parallelize(eager, mesh, torch.device("cpu"))
    parallelize(compiled, mesh, torch.device("cpu"), compile_layers=True)
    for m in (eager, compiled):
        use_packed_attention(m)
    return eager, compiled
