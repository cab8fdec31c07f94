"""Hand-computed cases for every loss, and V-trace against torchrl."""
from __future__ import annotations

import math

import pytest
import torch

from streamrl.algorithms.losses import (Normalizers, PolicyLossSpec, aggregate, gspo_loss, importance_weights,
                                        policy_loss, ppo_clip_token_loss)
from streamrl.algorithms.regularizers import kl_penalty, token_entropy
from streamrl.algorithms.vtrace import vtrace, vtrace_losses

from tests.learner_helpers import ppo_clip_tis_loss


def _ratio_logp(r: float) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0]])
    return old + math.log(r), old


@pytest.mark.parametrize("eps_high,passes", [(0.28, True), (0.2, False)])
def test_clip_higher_lets_ratio_through(eps_high, passes):
    logp, old = _ratio_logp(1.25)
    logp.requires_grad_(True)
    loss, ratio, clipped = ppo_clip_token_loss(logp, old, torch.tensor([1.0]), 0.2, eps_high)
    loss.sum().backward()
    assert torch.allclose(ratio, torch.tensor([[1.25]]))
    if passes:  # unclipped: loss = -r * A, gradient d(-r)/dlogp = -r
        assert loss.item() == pytest.approx(-1.25)
        assert logp.grad.item() == pytest.approx(-1.25)
        assert not clipped.item()
    else:  # clipped at 1.2: constant, no gradient
        assert loss.item() == pytest.approx(-1.2)
        assert logp.grad.item() == 0.0
        assert clipped.item()


def test_dual_clip_caps_negative_advantage():
    logp, old = _ratio_logp(10.0)
    adv = torch.tensor([-2.0])
    plain, _, _ = ppo_clip_token_loss(logp, old, adv, 0.2, 0.28)
    capped, _, clipped = ppo_clip_token_loss(logp, old, adv, 0.2, 0.28, dual_clip=3.0)
    assert plain.item() == pytest.approx(20.0)  # -A r = 2 * 10
    assert capped.item() == pytest.approx(6.0)  # c |A| = 3 * 2
    assert clipped.item()
    # positive advantages are untouched by the dual clip
    pos, _, _ = ppo_clip_token_loss(logp, old, torch.tensor([2.0]), 0.2, 0.28, dual_clip=3.0)
    assert pos.item() == pytest.approx(-2.0 * 1.28)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_token_loss(logp, old, adv, dual_clip=0.5)


def test_token_mask_leaves_denominator():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(2.0)  # (1+2+3)/3
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx((3 / 4 + 3 / 4) / 2)
    # global denominators (data-parallel split): rank sums / global counts
    assert aggregate(x, mask, "token-mean", num_tokens=6).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(x, mask, "bogus")


def test_importance_weight_modes():
    prox = torch.tensor([[0.0, 0.0, 0.0]])
    behav = torch.log(torch.tensor([[0.5, 1.0, 0.25]]))  # w = 2, 1, 4
    mask = torch.ones(1, 3)
    w, raw = importance_weights(prox, behav, mask, "token-tis", cap=3.0)
    assert torch.allclose(raw, torch.tensor([[2.0, 1.0, 4.0]]))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 3.0]]))
    w, _ = importance_weights(prox, behav, mask, "token-mis", cap=3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0]]))
    w, raw = importance_weights(prox, behav, mask, "seq-tis", cap=3.0)  # seq weight 8
    assert torch.allclose(raw, torch.full((1, 3), 8.0)) and torch.allclose(w, torch.full((1, 3), 3.0))
    w, _ = importance_weights(prox, behav, mask, "seq-mis", cap=10.0)
    assert torch.allclose(w, torch.full((1, 3), 8.0))
    # a masked token does not enter the sequence weight
    w, raw = importance_weights(prox, behav, torch.tensor([[1.0, 1.0, 0.0]]), "seq-tis", cap=10.0)
    assert torch.allclose(raw, torch.full((1, 3), 2.0))


def test_policy_loss_gradient_is_weighted_pg():
    torch.manual_seed(0)
    logp = torch.randn(3, 4).clamp(max=-0.1).requires_grad_(True)
    behav = logp.detach() + 0.3 * torch.randn(3, 4)
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 4)
    loss, stats = policy_loss(logp, logp.detach(), behav, adv, mask, PolicyLossSpec(is_mode="token-tis", is_cap=1.5))
    loss.backward()
    w = torch.exp(logp.detach() - behav).clamp(max=1.5)
    assert torch.allclose(logp.grad, -(w * adv[:, None]) / 12, atol=1e-6)
    assert stats["clip_frac"] == 0.0
    # the skeleton's entry point is the same loss
    l2, _ = ppo_clip_tis_loss(logp, logp.detach(), behav, adv, mask, tis_cap=1.5)
    assert torch.allclose(loss, l2)


def test_coupled_ppo_uses_behaviour_ratio():
    logp = torch.tensor([[math.log(0.5)]])
    behav = torch.tensor([[math.log(0.25)]])  # r = pi / mu = 2 -> clipped at 1.28 for A > 0
    loss, stats = policy_loss(logp, logp, behav, torch.tensor([1.0]), torch.ones(1, 1), PolicyLossSpec(coupled=True))
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_frac"] == 1.0


def test_gspo_sequence_ratio_and_clip():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, -0.1], [0.2, 0.2]], requires_grad=True)  # s = 1, e^0.2
    mask = torch.ones(2, 2)
    loss, stats = gspo_loss(logp, old, torch.tensor([1.0, 1.0]), mask, 3e-4, 4e-4)
    # seq 0: s=1, unclipped -> -1; seq 1: clipped at 1+4e-4 -> constant
    assert loss.item() == pytest.approx((-1.0 - 1.0004) / 2, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad[0], torch.tensor([-0.25, -0.25]))  # -A * s / n_tok / B
    assert torch.all(logp.grad[1] == 0)
    assert stats["clip_frac"] == 0.5


def test_kl_estimators_and_entropy():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_penalty(logp, logp, "k3").item() == 0.0
    ent = token_entropy(torch.zeros(1, 1, 4))
    assert ent.item() == pytest.approx(math.log(4))


def test_vtrace_rho_one_is_n_step_return():
    gamma = 0.9
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    v = torch.tensor([[0.5, -1.0, 2.0, 0.3]])
    boot = 7.0
    next_v = torch.cat([v[:, 1:], torch.tensor([[boot]])], -1)
    done = torch.zeros(1, 4, dtype=torch.bool)
    vs, adv = vtrace(torch.zeros(1, 4), v, next_v, r, done, gamma, rho_bar=1.0, c_bar=1.0)
    for s in range(4):
        ret = sum(gamma ** (t - s) * r[0, t].item() for t in range(s, 4)) + gamma ** (4 - s) * boot
        assert vs[0, s].item() == pytest.approx(ret, rel=1e-6)
    vs_next = torch.cat([vs[:, 1:], torch.tensor([[boot]])], -1)
    assert torch.allclose(adv, r + gamma * vs_next - v)


def test_vtrace_matches_torchrl_on_random_data():
    from torchrl.objectives.value.functional import vtrace_advantage_estimate

    torch.manual_seed(3)
    b, t = 4, 9
    log_pi = -torch.rand(b, t)
    log_mu = -torch.rand(b, t)
    v = torch.randn(b, t)
    next_v = torch.randn(b, t)
    r = torch.randn(b, t)
    done = torch.rand(b, t) < 0.2
    vs, adv = vtrace(log_pi - log_mu, v, next_v, r, done, 0.95, rho_bar=1.3, c_bar=0.9)
    # torchrl wants a trailing feature dim; its rho is exp(log_pi - log_mu) with log_pi = target.
    ta, tvs = vtrace_advantage_estimate(0.95, log_pi[..., None], log_mu[..., None], v[..., None],
                                        next_v[..., None], r[..., None], done[..., None],
                                        rho_thresh=1.3, c_thresh=0.9)
    assert torch.allclose(vs, tvs[..., 0], atol=1e-5)
    assert torch.allclose(adv, ta[..., 0], atol=1e-5)


def test_vtrace_losses_gradients():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    values = torch.tensor([[0.5, 0.0]], requires_grad=True)
    vs = torch.tensor([[1.5, 1.0]])
    adv = torch.tensor([[2.0, -1.0]])
    pol, val = vtrace_losses(logp, values, vs, adv, torch.tensor([[1.0, 0.0]]))
    (pol + val).backward()
    assert logp.grad.tolist() == [[-2.0, 0.0]]
    assert values.grad.tolist() == [[-1.0, 0.0]]


def test_decoupled_ppo_is_the_untruncated_behaviour_weight():
    """decoupled_ppo (AReaL's paper objective) weighs by pi_prox/mu without a cap; grpo_tis
    truncates the same weight at tis_cap, grpo_mis drops the token."""
    from streamrl.config import LearnerConfig
    from streamrl.learner.step_loss import compute_policy_loss

    logp = torch.tensor([[-1.0]])
    behav = logp - math.log(3.0)  # pi_prox / mu = 3 > tis_cap = 2
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    got = {}
    for loss in ("decoupled_ppo", "grpo_tis", "grpo_mis"):
        cfg = LearnerConfig(loss=loss, tis_cap=2.0)
        got[loss] = compute_policy_loss(cfg, logp, logp, behav, adv, mask, Normalizers(cfg.agg, 1.0, 1.0, 1.0))[0].item()
    assert got == pytest.approx({"decoupled_ppo": -3.0, "grpo_tis": -2.0, "grpo_mis": 0.0})
