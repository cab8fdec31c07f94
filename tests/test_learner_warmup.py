"""The learner's warm-up (:mod:`streamrl.learner.warmup`) leaves no trace.

A learner that ran :meth:`Trainer.warm_up` on the synthetic step-shaped batch, then trained two
real steps, holds bit-identical weights, AdamW state, router EMA and step count to one that
trained the same steps without it: on 1 rank and on 2 FSDP gloo ranks (the warm-up's
micro-batches run the same collectives on every rank), tiny Qwen3-MoE with routed-expert replay,
a router EMA and router losses on.
"""
from __future__ import annotations

import pytest
import torch

from streamrl.config import load_config
from streamrl.learner.trainer import Trainer
from streamrl.learner.warmup import synthetic_batch, warm_up_pays
from streamrl.parallel.expert_parallel import full_parameter
from streamrl.trajectory import split_trajectories

from tests.dist_helpers import spawn_gloo
from tests.learner_helpers import router_ema_state

from test_checkpoint import REPO
from test_packing import BASE, group_batch

OVERRIDES = [*BASE, "learner.router_ema=0.9", "learner.groups_per_step=3", "rollout.group_size=4",
             "learner.max_tokens_per_microbatch=40"]


def _state(tr: Trainer) -> dict[str, torch.Tensor]:
    """Full weights, AdamW moments and router EMA of ``tr`` (gathered over the ranks)."""
    out = {}
    for name, p in tr.model.named_parameters():
        out[name] = full_parameter(name, p.detach(), tr.mesh).clone()
        for k, v in tr.optim.state.get(p, {}).items():
            out[f"{name}/{k}"] = (full_parameter(name, v, tr.mesh) if v.ndim else v).clone()
    for name, v in router_ema_state(tr).items():
        out[f"ema/{name}"] = v.clone()
    return out


def _train(rank, world, warm: bool):
    torch.manual_seed(0)
    tr = Trainer(load_config(f"{REPO}/configs/tiny.yaml", OVERRIDES))
    if warm:
        tr.warm_up()
    metrics = [tr.step(group_batch(seed)) for seed in (1, 2)]
    return {"state": _state(tr), "steps_done": tr.steps_done, "loss": [m["learner/loss"] for m in metrics]}


def _assert_same(warm: dict, cold: dict) -> None:
    assert warm["steps_done"] == cold["steps_done"] == 2
    assert warm["loss"] == cold["loss"]
    assert warm["state"].keys() == cold["state"].keys()
    assert any(k.startswith("ema/") for k in cold["state"]) and any(k.endswith("/exp_avg") for k in cold["state"])
    for k, v in cold["state"].items():
        assert torch.equal(warm["state"][k], v), k


def test_warm_up_changes_nothing_one_rank():
    _assert_same(_train(0, 1, warm=True), _train(0, 1, warm=False))


def test_warm_up_changes_nothing_two_fsdp_ranks():
    warm = spawn_gloo(_train, 2, True)
    cold = spawn_gloo(_train, 2, False)
    for w, c in zip(warm, cold):
        _assert_same(w, c)


def test_synthetic_batch_is_one_step_of_full_length_groups():
    cfg = load_config(f"{REPO}/configs/tiny.yaml", [*OVERRIDES, "rollout.max_new_tokens=7", "rollout.max_model_len=20"])
    batch = synthetic_batch(cfg, vocab_size=50, replay_layers=2, top_k=2, num_experts=4)
    trajs = split_trajectories(batch)
    assert len(trajs) == 3 * 4
    assert batch["response_lens"].tolist() == [7] * 12
    assert batch["prompt_lens"].tolist() == [13] * 12  # max_model_len - max_new_tokens < PROMPT_TOKENS
    assert batch["group_id"].tolist() == [i // 4 for i in range(12)]
    prompts = batch["prompt_tokens"].view(12, 13)
    assert all(torch.equal(prompts[i], prompts[i - i % 4]) for i in range(12))  # one prompt per group
    assert int(batch["prompt_tokens"].max()) < 50 and int(batch["response_tokens"].max()) < 50
    routed = batch["routed_experts"].view(12 * 7, 2, 2)
    assert (routed[..., 0] != routed[..., 1]).all()  # top-k ids are distinct experts


@pytest.mark.parametrize("overrides,pays", [
    ([], False),                                   # eager CPU: nothing to move out of the first step
    (["learner.compile=true"], True),
    (["learner.device=cuda"], True),
    (["learner.device=cuda", "learner.warm_up=false"], False),
])
def test_warm_up_runs_where_the_first_step_pays_once(overrides, pays):
    assert warm_up_pays(load_config(f"{REPO}/configs/tiny.yaml", overrides)) is pays
