"""MoE router losses against transformers, and the EP block against the HF block (1 process)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from streamrl.algorithms.moe_losses import load_balancing_loss, router_z_loss


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_transformers(masked):
    torch.manual_seed(0)
    b, t, e, k, layers = 3, 5, 8, 2, 4
    logits = tuple(torch.randn(b * t, e) * 2 for _ in range(layers))
    mask = (torch.rand(b, t) > 0.3).long() if masked else None
    ours = load_balancing_loss(logits, e, k, None if mask is None else mask.reshape(-1))
    theirs = load_balancing_loss_func(logits, e, k, mask)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)


def test_aux_loss_gradient_matches_transformers():
    torch.manual_seed(1)
    logits = tuple(torch.randn(12, 4, requires_grad=True) for _ in range(2))
    load_balancing_loss(logits, 4, 2).backward()
    ours = [lg.grad.clone() for lg in logits]
    for lg in logits:
        lg.grad = None
    load_balancing_loss_func(logits, 4, 2).backward()
    for a, lg in zip(ours, logits):
        assert torch.allclose(a, lg.grad, atol=1e-6)


def test_z_loss_by_hand():
    logits = [torch.zeros(2, 4), torch.log(torch.tensor([[1.0, 1.0], [2.0, 2.0]]))]
    # lse: layer0 log4 twice; layer1 log2, log4
    l4, l2 = torch.log(torch.tensor(4.0)), torch.log(torch.tensor(2.0))
    expect = (2 * l4**2 + l2**2 + l4**2) / 4
    assert torch.allclose(router_z_loss([logits[0]] + [torch.cat([logits[1], torch.zeros(2, 2) - 1e9], -1)]), expect)
    # a masked token leaves numerator and denominator
    got = router_z_loss([torch.zeros(2, 4)], token_mask=torch.tensor([1.0, 0.0]))
    assert torch.allclose(got, l4**2)
