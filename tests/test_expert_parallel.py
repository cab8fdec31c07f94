"""Expert-parallel MoE block: equals the HF block, and EP=2 (2 gloo ranks) equals EP=1."""
from __future__ import annotations

import copy

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.models.factory import build_model
from streamrl.models.families import RoutingSpec
from streamrl.models.moe import EPMoEBlock, convert_moe_blocks, route
from streamrl.parallel.mesh import ParallelConfigError, ParallelDims

from tests.dist_helpers import spawn_gloo

MCFG = ModelConfig(num_experts=4, experts_per_token=2, num_layers=1)


def _block_and_inputs(seed=0, n=10):
    model, _ = build_model(MCFG, seed=seed)
    hf = model.model.layers[0].mlp
    torch.manual_seed(seed + 1)
    x = torch.randn(2, n // 2, MCFG.hidden_size)
    with torch.no_grad():  # spread the router so every expert gets tokens
        hf.gate.weight.normal_(0, 1.0)
    return model, hf, x


def test_ep1_block_matches_hf_block():
    _, hf, x = _block_and_inputs()
    ours = EPMoEBlock(copy.deepcopy(hf), RoutingSpec(MCFG.experts_per_token, True))
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf, y = hf(x1), ours(x2)
    assert torch.allclose(y_hf, y, atol=1e-6)
    (y_hf ** 2).sum().backward()
    (y ** 2).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    assert torch.allclose(hf.experts.gate_up_proj.grad, ours.experts.gate_up_proj.grad, atol=1e-5)
    assert torch.allclose(hf.gate.weight.grad, ours.gate.weight.grad, atol=1e-5)
    assert ours.last_router_logits.shape == (10, MCFG.num_experts)


def test_route_replay_and_deterministic_ties():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0]])
    w, idx = route(logits, 2, True, deterministic=True)
    assert idx[0].tolist() == [0, 1]  # ties broken by the lower expert id
    assert idx[1].tolist() == [1, 2]
    replay = torch.tensor([[3, 2], [-1, -1]], dtype=torch.int16)
    w, idx = route(logits, 2, True, replay)
    assert idx[0].tolist() == [3, 2] and idx[1].tolist() == [1, 2]
    p = torch.softmax(logits[0], -1)
    assert torch.allclose(w[0], p[[3, 2]] / p[[3, 2]].sum())


def test_parallel_dims_validation():
    assert ParallelDims(4, 2).validate(8).dp_shard == 2
    with pytest.raises(ParallelConfigError, match="learner.ep = 3"):
        ParallelDims(4, 3).validate(6)
    with pytest.raises(ParallelConfigError, match="divide the number of experts"):
        ParallelDims(4, 4).validate(6)
    with pytest.raises(ParallelConfigError, match="no experts"):
        ParallelDims(2, 2).validate(0)


def _ep_worker(rank, world):
    import torch.distributed as dist

    model, hf, x = _block_and_inputs()
    group = dist.new_group(list(range(world)))
    blocks = convert_moe_blocks(model, rank, world, group)
    blk = blocks[0]
    xs = x.reshape(-1, x.shape[-1])
    mine = xs[rank::world].clone().requires_grad_(True)  # each rank routes its own tokens
    y = blk(mine.unsqueeze(0))
    (y ** 2).sum().backward()
    return {"y": y.detach()[0], "xg": mine.grad, "gu": blk.experts.gate_up_proj.grad,
            "dn": blk.experts.down_proj.grad, "router": blk.gate.weight.grad}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep2_matches_ep1():
    model, hf, x = _block_and_inputs()
    ref = convert_moe_blocks(model)[0]
    xs = x.reshape(-1, x.shape[-1]).clone().requires_grad_(True)
    y = ref(xs.unsqueeze(0))[0]
    (y ** 2).sum().backward()
    out = spawn_gloo(_ep_worker, 2, timeout_s=300)
    el = MCFG.num_experts // 2
    router = torch.zeros_like(out[0]["router"])
    for r, o in enumerate(out):
        assert torch.allclose(o["y"], y.detach()[r::2], atol=1e-5)
        assert torch.allclose(o["xg"], xs.grad[r::2], atol=1e-5)
        # a rank's experts saw the tokens of both ranks through the all-to-all
        assert torch.allclose(o["gu"], ref.experts.gate_up_proj.grad[r * el:(r + 1) * el], atol=1e-5)
        assert torch.allclose(o["dn"], ref.experts.down_proj.grad[r * el:(r + 1) * el], atol=1e-5)
        router += o["router"]
    assert torch.allclose(router, ref.gate.weight.grad, atol=1e-5)
