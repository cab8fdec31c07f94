"""``learner.drop_zero_advantage``: samples whose advantage is 0 on every loss token leave the
forward/backward, and the gradient is the one of the full step (float tolerance).

Compared with the knob off (today's micro-batches, every sample in): every parameter's gradient,
the loss, and which trajectories the micro-batches hold; on 1 rank and on 2 FSDP gloo ranks
(the filter runs before the split over ranks, so both ranks keep the same number of
micro-batches), for sequence and token advantages, with and without shared prompts, on a
dense Llama and the tiny Qwen3-MoE (router losses off). Where another term trains on every
sample (KL, entropy bonus, MoE router losses) nothing is left out.
"""
from __future__ import annotations

import pytest
import torch

from streamrl.bench.padded_reference import packed_gradients
from streamrl.config import load_config
from streamrl.learner.trainer import Trainer

from tests.dist_helpers import spawn_gloo

from test_bench_learner import save_tiny_llama
from test_checkpoint import REPO
from test_packing import BASE, _full_grads, group_batch

# Router losses off: with them the drop is not exact and must not happen (tested below).
MOE = [*BASE, "learner.z_loss_coef=0", "learner.aux_loss_coef=0", "learner.max_tokens_per_microbatch=30"]


def zero_adv_batch(seed: int, groups: int, g: int, zero_groups: set[int], token: bool = False):
    """``groups x g`` trajectories (:func:`group_batch`) whose groups in ``zero_groups`` have
    identical rewards, so every advantage of their samples is exactly 0. ``token``: per-token
    rewards too (random elsewhere; one reward on the last token in a zero group)."""
    batch = group_batch(seed, groups=groups, g=g)
    gid, r_lens = batch["group_id"].tolist(), batch["response_lens"].tolist()
    batch["reward"] = torch.tensor([0.5 if gi in zero_groups else float(r) for gi, r in
                                    zip(gid, batch["reward"].tolist())])
    if token:
        gen = torch.Generator().manual_seed(seed)
        per = [[0.0] * (r - 1) + [0.5] if gi in zero_groups else torch.rand(r, generator=gen).tolist()
               for gi, r in zip(gid, r_lens)]
        batch["token_rewards"] = torch.tensor([x for t in per for x in t])
    return batch


def _config(extra, drop: bool, dense_folder: str | None):
    token = any(e == "learner.advantage=token" for e in extra)
    over = [*MOE, *([f"model.path={dense_folder}"] if dense_folder else []),
            *(["rollout.token_rewards=true"] if token else []), *extra,
            f"learner.drop_zero_advantage={str(drop).lower()}"]
    return load_config(f"{REPO}/configs/tiny.yaml", over)


def _trained_rows(tr: Trainer, batch) -> list[list[int]]:
    """The trajectories each of this rank's micro-batches runs (dummies: [])."""
    plans = tr._prepare(batch)[3]
    return [[] if m.dummy else list(m.rows) for micro, _ in plans for m in micro]


def _grads(rank, world, batch, extra, drop, dense_folder=None):
    tr = Trainer(_config(extra, drop, dense_folder))
    m = packed_gradients(tr, batch)
    return {"loss": m["learner/loss"], "dropped": m["learner/dropped_zero_adv_frac"], "g": _full_grads(tr),
            "rows": _trained_rows(tr, batch)}


def _assert_grads_equal(a: dict, b: dict) -> None:
    assert a["g"].keys() == b["g"].keys() and a["g"]
    assert any(v.abs().max() > 0 for v in a["g"].values()), "no gradient compared"
    for k, v in b["g"].items():
        assert torch.allclose(a["g"][k], v, atol=1e-7, rtol=1e-5), (k, (a["g"][k] - v).abs().max())
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8)


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-drop"), hidden_size=32, head_dim=16))


@pytest.mark.parametrize("model", ["moe", "dense"])
@pytest.mark.parametrize("extra", [
    [],  # shared prompts, sequence advantages
    ["learner.shared_prompt=false"],
    ["learner.advantage=token"],
    ["learner.advantage=token", "learner.shared_prompt=false", "learner.agg=seq-mean-token-mean"],
    ["learner.loss=ppo_coupled", "learner.agg=seq-mean-token-sum-norm", "learner.dual_clip=3"],
])
def test_drop_leaves_the_gradient_unchanged_one_rank(model, extra, dense_folder):
    # groups 0 and 2 of 4 agree: their 6 samples leave the micro-batches; group 1 keeps its prompt
    batch = zero_adv_batch(3, groups=4, g=3, zero_groups={0, 2}, token="learner.advantage=token" in extra)
    folder = dense_folder if model == "dense" else None
    on, off = _grads(0, 1, batch, extra, True, folder), _grads(0, 1, batch, extra, False, folder)
    _assert_grads_equal(on, off)
    assert on["dropped"] == 0.5 and off["dropped"] == 0.0
    assert sorted(r for rows in on["rows"] for r in rows) == [3, 4, 5, 9, 10, 11]
    assert sorted(r for rows in off["rows"] for r in rows) == list(range(12))  # knob off: every sample, as today
    assert len(on["rows"]) < len(off["rows"])  # fewer micro-batches to run


def _two_rank_cases(rank, world, dense_folder):
    # 12 samples, groups 2 and 3 agree: without the filter rank 1's whole share (samples 6-11)
    # would be zero-advantage; filtered first, each rank trains 3 of the 6 kept samples.
    out = []
    for extra in ([], ["learner.advantage=token", "learner.shared_prompt=false"]):
        batch = zero_adv_batch(5, groups=4, g=3, zero_groups={2, 3}, token=bool(extra))
        out.append({"on": _grads(rank, world, batch, extra, True, dense_folder),
                    "off": _grads(rank, world, batch, extra, False, dense_folder)})
    return out


def test_drop_leaves_the_gradient_unchanged_two_fsdp_ranks(dense_folder):
    ranks = spawn_gloo(_two_rank_cases, 2, dense_folder, timeout_s=240)
    one = _two_rank_cases(0, 1, dense_folder)
    for case in range(2):
        on = [r[case]["on"] for r in ranks]
        assert [sorted(x for rows in o["rows"] for x in rows) for o in on] == [[0, 1, 2], [3, 4, 5]]
        assert len(on[0]["rows"]) == len(on[1]["rows"])  # lockstep: same number of micro-batches
        for r in ranks:
            _assert_grads_equal(r[case]["on"], r[case]["off"])
            _assert_grads_equal(r[case]["on"], one[case]["off"])  # and the 1-rank gradient without the drop


@pytest.mark.parametrize("extra", [
    ["learner.kl_coef=0.1"],
    ["learner.entropy_coef=0.01"],
    ["learner.aux_loss_coef=0.01"],
    ["learner.z_loss_coef=0.01"],
    ["learner.router_freeze_steps=5", "learner.router_unfreeze_min_entropy=0.5"],
])
def test_no_drop_where_every_sample_trains(extra):
    """KL, entropy bonus, router losses (or the unfreeze gate reading router metrics): each
    reaches zero-advantage samples too, so all of them stay in."""
    batch = zero_adv_batch(3, groups=4, g=3, zero_groups={0, 2})
    m = _grads(0, 1, batch, extra, True)
    assert m["dropped"] == 0.0
    assert sorted(r for rows in m["rows"] for r in rows) == list(range(12))


def test_step_with_minibatches_and_everything_dropped_in_one():
    """minibatches = 2 (the proximal pre-pass runs on the kept samples only): the first
    minibatch is all zero-advantage, its one zero-weight micro-batch still gives AdamW its zero
    gradient; the step lands on the weights of the step without the drop."""
    batch = zero_adv_batch(9, groups=4, g=3, zero_groups={0, 1})
    params, metrics = [], []
    for drop in (True, False):
        tr = Trainer(_config(["learner.minibatches=2", "learner.grad_clip=1e9"], drop, None))
        metrics.append(tr.step(batch))
        params.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})
        if drop:
            plans = tr._prepare(batch)[3]
            assert [[m.dummy for m in micro] for micro, _ in plans][0] == [True]
    assert metrics[0]["learner/dropped_zero_adv_frac"] == 0.5
    assert metrics[0]["learner/loss"] == pytest.approx(metrics[1]["learner/loss"], rel=1e-5, abs=1e-8)
    for k, v in params[1].items():
        # Adam's first steps are ~lr * sign(g): 1e-4 (lr = 1e-3) would catch any flipped sign
        assert torch.allclose(params[0][k], v, atol=1e-4), k
