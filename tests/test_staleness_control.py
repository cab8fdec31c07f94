"""Adaptive staleness: the controller on synthetic signals, the admission script against a real
Redis honouring the published bound, and the ESS / behaviour-KL figures against a hand computation."""
from __future__ import annotations

import math
import random

import pytest
import torch

from streamrl.algorithms.losses import Normalizers, behaviour_gap_stats, normalised_ess
from streamrl.config import ConfigError, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.metrics import MetricSums, read_minibatch_metrics
from streamrl.learner.staleness_control import (StalenessController, StalenessGovernor, StalenessSignals,
                                                StalenessTargets)
from streamrl.learner.step_loss import ForwardOutputs, LossTargets, StepLoss

HEALTHY = StalenessSignals(ess=0.99, clip_frac=0.01, kl_behaviour=0.001, idle_frac=0.02)
STARVING = StalenessSignals(ess=0.99, clip_frac=0.01, kl_behaviour=0.001, idle_frac=0.5)


def _run(ctl: StalenessController, signals, steps: int) -> list[int]:
    return [ctl.update(signals) for _ in range(steps)]


@pytest.mark.parametrize("bad", [dict(ess=0.5), dict(clip_frac=0.5), dict(kl_behaviour=0.5)])
def test_tightens_to_the_floor_when_too_off_policy_even_while_starving(bad):
    ctl = StalenessController(floor=1, ceiling=8, interval=3)
    start = ctl.bound
    bounds = _run(ctl, StalenessSignals(**{**STARVING.__dict__, **bad}), 60)
    assert bounds[-1] == 1 and min(bounds) == 1 and max(bounds) <= start
    assert all(b >= a - 1 for a, b in zip(bounds, bounds[1:]))  # one version per change


def test_loosens_to_the_ceiling_when_starving_with_healthy_signals():
    ctl = StalenessController(floor=1, ceiling=8, interval=3)
    bounds = _run(ctl, STARVING, 60)
    assert bounds[-1] == 8 and max(bounds) == 8 and all(1 <= b <= 8 for b in bounds)


def test_holds_when_fed_and_healthy_and_in_the_dead_band():
    ctl = StalenessController(floor=1, ceiling=8, interval=2)
    start = ctl.bound
    assert set(_run(ctl, HEALTHY, 40)) == {start}  # not starving: nothing to buy
    t = StalenessTargets()
    # starving, but the ESS only just above its target (inside the margin): no loosening
    edge = StalenessSignals(ess=t.ess_min + 0.01, clip_frac=0.0, kl_behaviour=0.0, idle_frac=0.9)
    assert set(_run(StalenessController(floor=1, ceiling=8, interval=2), edge, 40)) == {start}


def test_rate_limited_one_change_per_interval():
    ctl = StalenessController(floor=0, ceiling=10, interval=4)
    bounds = _run(ctl, STARVING, 21)
    changes = [i for i in range(1, len(bounds)) if bounds[i] != bounds[i - 1]]
    assert changes and all(b - a >= 4 for a, b in zip(changes, changes[1:]))
    assert bounds[:3] == [ctl.floor + 5] * 3  # nothing before the first interval has passed


def test_no_oscillation_on_a_noisy_constant_signal():
    """Signals that hover around the ESS target (noise of +-0.05 per step): the smoothed signal
    settles, the bound goes one way and stays, instead of flapping with each draw."""
    rng = random.Random(0)
    ctl = StalenessController(floor=1, ceiling=8, interval=3)
    bounds = [ctl.update(StalenessSignals(ess=min(1.0, 0.93 + rng.uniform(-0.05, 0.05)), clip_frac=0.02,
                                          kl_behaviour=0.005, idle_frac=0.3 + rng.uniform(-0.2, 0.2)))
              for _ in range(300)]
    reversals = sum(1 for a, b, c in zip(bounds, bounds[1:], bounds[2:]) if (b - a) * (c - b) < 0)
    steps = [b - a for a, b in zip(bounds, bounds[1:]) if b != a]
    assert all(1 <= b <= 8 for b in bounds) and reversals == 0 and len(set(steps)) <= 1


def test_bounds_and_settings_are_validated():
    with pytest.raises(ValueError, match="floor"):
        StalenessController(floor=5, ceiling=2)
    with pytest.raises(ValueError, match="ema"):
        StalenessController(floor=0, ceiling=2, ema=1.0)
    with pytest.raises(ConfigError, match="learner.staleness_min"):
        load_config(None, ["learner.staleness=adaptive", "learner.max_staleness=2", "learner.staleness_min=3"])
    with pytest.raises(ConfigError, match="learner.staleness'"):
        load_config(None, ["learner.staleness=auto"])
    with pytest.raises(ConfigError, match="learner.staleness_ess_min"):
        load_config(None, ["learner.staleness=adaptive", "learner.staleness_ess_min=1.5"])


@pytest.mark.timeout(30)
def test_admission_honours_the_published_bound(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    c.r.set(c.keys.version, 0)
    per_step, ceiling = 4, 6

    def admitted() -> int:
        n = 0
        while c.try_reserve(1, ceiling, per_step):
            n += 1
        c.set_capacity(0)
        return n

    assert c.staleness_bound() is None
    assert admitted() == (ceiling + 1) * per_step  # no published bound: the worker's ceiling
    c.set_staleness_bound(2)
    assert c.staleness_bound() == 2 and admitted() == (2 + 1) * per_step
    c.set_staleness_bound(0)
    assert admitted() == per_step  # on-policy: one step's groups
    c.set_staleness_bound(50)
    assert admitted() == (ceiling + 1) * per_step  # never above the worker's ceiling


@pytest.mark.timeout(30)
def test_governor_publishes_adaptive_bounds_and_leaves_fixed_alone(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    fixed = StalenessGovernor(load_config(None, ["learner.max_staleness=4"]).learner, c)
    assert fixed.step({"learner/idle_frac": 0.9}) == {"learner/staleness_bound": 4.0}
    assert c.staleness_bound() is None
    lc = load_config(None, ["learner.staleness=adaptive", "learner.max_staleness=4", "learner.staleness_min=1",
                            "learner.staleness_interval=1"]).learner
    gov = StalenessGovernor(lc, c)
    assert c.staleness_bound() == gov.bound == 2
    reported = [gov.step({"learner/idle_frac": 0.9, "learner/is_ess": 1.0})["learner/staleness_bound"]
                for _ in range(4)]
    assert reported == [2.0, 3.0, 4.0, 4.0] and c.staleness_bound() == 4
    c.r.delete(c.keys.staleness_bound)  # Redis restarted: the next step writes the bound again
    bad = {"learner/idle_frac": 0.0, "learner/is_ess": 0.1}
    for _ in range(3):  # skipped steps measured nothing: the bound stays
        gov.step({**bad, "learner/skipped_no_signal": 1.0})
    assert c.staleness_bound() == 4
    gov.step({**bad, "learner/skipped_no_signal": 0.0})
    assert c.staleness_bound() == 3


def test_ess_and_behaviour_kl_match_a_hand_computation():
    prox = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 0.0]])
    behav = torch.tensor([[-0.2, -1.0, -1.0], [-1.0, -0.4, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token is not in the loss
    log_w = [0.2, 0.0, -1.0, 0.5, -0.1]
    w = [math.exp(x) for x in log_w]
    st = behaviour_gap_stats(prox, behav, mask)
    mean, sq = float(st["behaviour_weight_mean"]), float(st["behaviour_weight_sq_mean"])
    assert mean == pytest.approx(sum(w) / 5) and sq == pytest.approx(sum(x * x for x in w) / 5)
    assert normalised_ess(mean, sq) == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    kl = sum(x - 1 - lx for x, lx in zip(w, log_w)) / 5
    assert float(st["kl_behaviour"]) == pytest.approx(kl)
    same = behaviour_gap_stats(prox, prox, mask)
    assert normalised_ess(float(same["behaviour_weight_mean"]), float(same["behaviour_weight_sq_mean"])) == 1.0
    assert float(same["kl_behaviour"]) == 0.0


def test_step_ess_and_kl_over_micro_batches_are_those_of_all_the_step_tokens():
    """Two micro-batches of different sizes through StepLoss and the step's metric reading: the
    ESS and KL are the ones of the step's tokens pooled, not a mean of per-micro-batch values."""
    lc = load_config(None, ["learner.loss=grpo_tis"]).learner
    loss_fn, sums = StepLoss(lc), MetricSums()
    gen = torch.Generator().manual_seed(0)
    all_log_w = []
    for rows, width in ((1, 2), (3, 4)):
        logp = torch.randn(rows, width, generator=gen)
        behav = logp + 0.5 * torch.randn(rows, width, generator=gen)
        mask = torch.ones(rows, width)
        all_log_w.append((logp - behav).flatten())
        tgt = LossTargets(prox_logp=logp, behav_logp=behav, advantages=torch.ones(rows), mask=mask,
                          tokens=float(mask.sum()))
        _, metrics = loss_fn(ForwardOutputs(logp=logp.clone().requires_grad_()), tgt, Normalizers(num_tokens=14.0))
        sums.add_all(metrics)
        sums.tokens += float(mask.sum())
    out = read_minibatch_metrics([sums], world=1)[0]
    w = torch.cat(all_log_w).double().exp()
    assert out["learner/is_ess"] == pytest.approx(float(w.sum() ** 2 / (w.numel() * (w * w).sum())))
    assert out["learner/kl_behaviour"] == pytest.approx(float((w - 1 - w.log()).mean()), rel=1e-5)
    assert "learner/behaviour_weight_sq_mean" not in out
