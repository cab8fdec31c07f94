"""FSDP2 (and FSDP2 + expert parallel) on 2 gloo ranks matches 1 rank after an optimizer step."""
from __future__ import annotations

import pytest
import torch

from streamrl.config import load_config
from streamrl.learner.trainer import Trainer

from tests.dist_helpers import assert_ranks_match_reference, spawn_gloo

from test_checkpoint import REPO, make_batch

OVERRIDES = ["learner.lr=1e-3", "learner.z_loss_coef=0.01", "learner.aux_loss_coef=0.05"]


def _one_step(rank, world, ep):
    cfg = load_config(f"{REPO}/configs/tiny.yaml", [f"learner.ep={ep}", *OVERRIDES])
    tr = Trainer(cfg)
    m = tr.step(make_batch(7, n=8))
    params = {name: t.clone() for (name, _, _), t in zip(tr.param_specs, tr.full_tensors())}
    keys = ("learner/loss", "learner/grad_norm", "moe/aux_loss", "moe/z_loss", "moe/router_entropy")
    return {"metrics": {k: m[k] for k in keys}, "params": params}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ep", [1, 2])
def test_two_ranks_match_one_rank(ep):
    ref = _one_step(0, 1, 1)
    assert_ranks_match_reference(ref, spawn_gloo(_one_step, 2, ep, timeout_s=300))
