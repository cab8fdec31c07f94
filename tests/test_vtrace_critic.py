"""The V-trace critic variant (``learner.loss = vtrace``): value head, targets, learning, FSDP2, resume, loop."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from streamrl.config import load_config
from streamrl.learner.critic import critic_targets, is_critic_param, response_mdp, value_head
from streamrl.learner.run_checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from streamrl.learner.trainer import Trainer
from streamrl.parallel.expert_parallel import full_parameter
from streamrl.trajectory import pack_trajectories, to_padded

from tests.dist_helpers import assert_ranks_match_reference, spawn_gloo
from tests.learner_helpers import evaluate_logprobs

from test_checkpoint import REPO, make_batch

VT = ["learner.loss=vtrace"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a loaded 2-core machine two OpenMP threads made 30 tiny steps
    take 28 s instead of 1 s (spin-waiting threads preempted); the gloo ranks already use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(*extra):
    return load_config(f"{REPO}/configs/tiny.yaml", [*VT, *extra])


def _all_params(tr) -> dict[str, torch.Tensor]:
    """Every full parameter, the value head included (a collective on every rank)."""
    return {n: full_parameter(n, p, tr.mesh).clone() for n, p in tr.model.named_parameters()}


def test_config_fields_validated():
    cfg = _cfg()
    lc = cfg.learner
    assert (lc.value_coef, lc.gamma, lc.vtrace_rho_bar, lc.vtrace_c_bar) == (0.5, 1.0, 1.0, 1.0)
    for bad, field in (("learner.value_coef=-1", "value_coef"), ("learner.gamma=0", "gamma"),
                       ("learner.vtrace_rho_bar=0", "vtrace_rho_bar"), ("learner.vtrace_c_bar=-2", "vtrace_c_bar"),
                       ("learner.loss=vtracee", "loss")):
        with pytest.raises(ValueError, match=field):
            _cfg(bad)


def test_rho_one_target_is_monte_carlo_return():
    """rho = 1, gamma = 1: every response position's target is the sequence reward, whatever V is."""
    g = torch.Generator().manual_seed(0)
    p_lens, r_lens = [3, 2, 4], [4, 1, 3]
    reward = torch.tensor([0.7, -1.0, 0.25])
    width = max(p + r for p, r in zip(p_lens, r_lens)) - 1
    rewards, done, resp = response_mdp(p_lens, r_lens, reward, width)
    values = torch.randn(3, width, generator=g)
    vs, adv = critic_targets(values, torch.zeros(3, width), rewards, done, resp, 1.0, 1.0, 1.0)
    want = reward[:, None].expand(3, width)
    assert torch.allclose(vs[resp], want[resp], atol=1e-6)
    # the advantage is the one-step TD error on the V-trace target: reward - V(x_t)
    assert torch.allclose(adv[resp], (want - values)[resp], atol=1e-6)
    assert int(done.sum()) == 3 and resp.sum(-1).tolist() == r_lens
    # gamma < 1: the reward is discounted by the distance to the last token
    vs_g, _ = critic_targets(values, torch.zeros(3, width), rewards, done, resp, 0.5, 1.0, 1.0)
    assert torch.allclose(vs_g[0, 2:6], 0.7 * torch.tensor([0.125, 0.25, 0.5, 1.0]), atol=1e-6)
    # far off-policy tokens (rho -> 0) keep the target at V
    vs_off, _ = critic_targets(values, torch.full((3, width), -50.0), rewards, done, resp, 1.0, 1.0, 1.0)
    assert torch.allclose(vs_off[resp], values[resp], atol=1e-6)


def test_value_head_not_published():
    tr = Trainer(_cfg())
    head = value_head(tr.model)
    assert head is not None and torch.count_nonzero(head.proj.weight) == 0  # V starts at 0
    names = [n for n, _ in tr.model.named_parameters()]
    assert sum(is_critic_param(n) for n in names) == 2
    spec_names = [s[0] for s in tr.param_specs]
    assert not any(is_critic_param(n) for n in spec_names)
    # the manifest is exactly the rollout model's parameters, tensor for tensor
    from streamrl.models.factory import load_model_and_tokenizer

    plain, _ = load_model_and_tokenizer(tr.cfg.model, seed=tr.cfg.run.seed)
    rollout = dict(plain.named_parameters())
    assert sorted(spec_names) == sorted(rollout)  # order differs: expert-parallel blocks re-register
    tensors = list(tr.full_tensors())
    assert len(tensors) == len(spec_names)
    for (n, dt, shape), t in zip(tr.param_specs, tensors):
        assert tuple(t.shape) == shape == tuple(rollout[n].shape) and t.dtype == dt, n
    # the critic's parameters are trained (in the optimizer), and a grpo trainer has none
    opt_ids = {id(p) for grp in tr.optim.param_groups for p in grp["params"]}
    assert all(id(p) in opt_ids for p in head.parameters())
    assert value_head(Trainer(load_config(f"{REPO}/configs/tiny.yaml", [])).model) is None


def _on_policy_batch(tr, seed: int, n: int = 8):
    """A batch whose behaviour log-probs are the trainer's own (rho = 1 at the start)."""
    b = make_batch(seed, n)
    pad = to_padded(b, tr.pad_id)
    lp = evaluate_logprobs(tr, pad["input_ids"], pad["attention_mask"])
    p_lens, r_lens = b["prompt_lens"].tolist(), b["response_lens"].tolist()
    b["behaviour_logprobs"] = torch.cat([lp[i, p - 1 : p - 1 + r] for i, (p, r) in enumerate(zip(p_lens, r_lens))])
    return b


def test_critic_learns_on_a_fixed_batch():
    torch.manual_seed(0)
    # unwhitened advantages: the policy then moves little on this fixed batch, so the critic's
    # targets stay put and the test measures the critic's learning alone
    tr = Trainer(_cfg("learner.vtrace_adv_norm=false"))
    batch = _on_policy_batch(tr, 11)
    hist = [tr.step(batch) for _ in range(30)]
    first = hist[0]
    # step 0: V = 0 and rho = 1, so the targets are the rewards (Monte-Carlo returns)
    assert first["learner/value_mean"] == 0.0
    pad = to_padded(batch, tr.pad_id)
    w = pad["loss_mask"].sum(-1)
    assert first["learner/vtrace_target_mean"] == pytest.approx(float((pad["reward"] * w).sum() / w.sum()), rel=1e-5)
    losses = [m["learner/value_loss"] for m in hist]
    assert min(losses[-5:]) * 5 < losses[0] and max(losses[-5:]) * 5 < losses[0], losses
    assert hist[-1]["learner/explained_variance"] > 0.5, hist[-1]


def _train(tmp: Path, steps: int, save_at=None, resume=False, extra=()):
    """Train ``steps`` vtrace steps (from the checkpoint when ``resume``); losses and all full params."""
    tr = Trainer(_cfg(f"run.run_dir={tmp}", "learner.lr=1e-2", *extra))
    start = 0
    if resume:
        start = load_checkpoint(latest_checkpoint(tmp / "ck"), tr)[0]["step"]
    out = []
    for s in range(start, steps):
        noise = float(torch.rand(()))  # RNG consumed between steps: resume must restore it
        m = tr.step(make_batch(200 + s))
        out.append((m["learner/loss"], m["learner/value_loss"], m["learner/grad_norm"], noise))
        if save_at is not None and s + 1 == save_at:
            save_checkpoint(tmp / "ck", s + 1, tr, {"version": s + 1})
            return out, None
    return out, _all_params(tr)


def _compare(full, first, resumed):
    assert first[0] + resumed[0] == full[0]  # bit-for-bit
    assert any(is_critic_param(k) for k in full[1])
    for k, v in full[1].items():
        assert torch.equal(v, resumed[1][k]), k


def test_resume_bit_exact_with_value_head(tmp_path):
    torch.manual_seed(0)
    full = _train(tmp_path / "a", 4)
    head = full[1]["streamrl_value_head.proj.weight"]
    assert torch.count_nonzero(head) > 0  # the head moved, so the comparison covers it
    torch.manual_seed(0)
    first = _train(tmp_path, 4, save_at=2)
    torch.manual_seed(99)
    resumed = _train(tmp_path, 4, resume=True)
    _compare(full, first, resumed)


def _one_step(rank, world, ep):
    cfg = _cfg("learner.lr=1e-3", "learner.minibatches=2", f"learner.ep={ep}")
    tr = Trainer(cfg)
    m = tr.step(make_batch(7, n=8))
    keys = ("learner/loss", "learner/value_loss", "learner/grad_norm", "learner/value_mean",
            "learner/vtrace_target_mean", "learner/explained_variance")
    return {"metrics": {k: m[k] for k in keys}, "params": _all_params(tr)}


@pytest.mark.slow  # 12 s on an idle 2-core machine, ~28 s under load: over the default tier's share
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [1, 2])
def test_two_ranks_match_one_rank(ep):
    """Real FSDP2 on 2 gloo ranks (two optimizer steps: minibatches = 2) equals 1 rank, value head included."""
    ref = _one_step(0, 1, 1)
    assert_ranks_match_reference(ref, spawn_gloo(_one_step, 2, ep, timeout_s=240))
    head = ref["params"]["streamrl_value_head.proj.weight"]
    assert torch.count_nonzero(head) > 0


def _dist_resume(rank, world, tmp, mode):
    tmp = Path(tmp)
    torch.manual_seed(0 if mode != "resume" else 5)
    if mode == "full":
        return _train(tmp, 4)
    if mode == "first":
        return _train(tmp, 4, save_at=2)
    return _train(tmp, 4, resume=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_bit_exact_two_ranks(tmp_path):
    full = spawn_gloo(_dist_resume, 2, str(tmp_path / "a"), "full", timeout_s=240)[0]
    first = spawn_gloo(_dist_resume, 2, str(tmp_path), "first", timeout_s=240)[0]
    resumed = spawn_gloo(_dist_resume, 2, str(tmp_path), "resume", timeout_s=240)[0]
    _compare(full, first, resumed)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_launch_vtrace_learns(tmp_path, repo, python):
    """The whole loop with the critic: rollouts load the published weights (no value head in the
    manifest, or they would refuse it) and the reward goes up."""
    run_dir = tmp_path / "vt"
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"),
         "--learners", "2", "--rollers", "2", "--steps", "30", "learner.loss=vtrace", "--run-dir", str(run_dir)],
        cwd=repo, capture_output=True, text=True, timeout=380,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["versions_published"] == 31
    assert summary["reward_last"] > summary["reward_first"] + 0.05, summary
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("learner/value_loss" in r and "learner/explained_variance" in r for r in rows)
    # rollouts loaded every version they fetched (a manifest mismatch logs "... will re-fetch")
    # and kept up: had they stayed on old weights, their samples would be dropped as stale
    for log in (run_dir / "logs").glob("rollout-*.log"):
        text = log.read_text()
        assert "mismatch" not in text and "re-fetch" not in text, text[-2000:]
    assert summary["samples_dropped_stale"] < 0.2 * summary["samples"], summary


def test_whitened_advantages_have_zero_mean_unit_std_on_the_mask():
    from streamrl.learner.critic import whiten_advantages

    g = torch.Generator().manual_seed(0)
    adv = torch.rand(4, 6, generator=g) * 3 + 1.0  # all positive, like V-trace's first steps
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    w = whiten_advantages(adv, mask)
    m = mask.bool()
    assert abs(float(w[m].mean())) < 1e-6
    assert float(w[m].std(unbiased=False)) == pytest.approx(1.0, rel=1e-4)
    assert (w[~m] == 0).all()
    assert (w[m] < 0).any()  # below-average tokens are now pushed down
