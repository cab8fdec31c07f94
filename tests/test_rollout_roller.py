"""The single-turn roller (streamrl.rollout.batch.BatchRoller) with the HF engine: packing, versions,
rewards, routing capture, parity."""
from __future__ import annotations

import itertools

import torch

from streamrl.config import load_config
from streamrl.engines.factory import build_engine
from streamrl.engines.hf import HFEngine
from streamrl.engines.parity import mismatch_metrics, probe_set
from streamrl.models.factory import build_model
from streamrl.rewards import register_reward
from streamrl.rollout.factory import build_roller
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks import get_task
from streamrl.tasks.registry import problem_stream
from streamrl.trajectory import validate_trajectories


def _cfg(*extra):
    return load_config("configs/tiny.yaml", ["rollout.group_size=3", "rollout.prompts_per_batch=2",
                                             "rollout.max_new_tokens=5", *extra])


def test_batch_is_valid_with_version_rewards_and_routing(repo, monkeypatch):
    monkeypatch.chdir(repo)
    cfg = _cfg("rollout.record_routing=true", "rollout.rewards=task=1.0,format=0.5")
    model, tok = build_model(cfg.model, seed=0)
    engine = build_engine(cfg, model, tok)
    task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
    roller = build_roller(cfg, engine, tok, problem_stream(task, 0, 0, 1), worker_id=3)
    td = roller.rollout_batch(version=7)
    validate_trajectories(td)
    n_resp = int(td["response_lens"].sum())
    assert td["reward"].shape == (6,) and (td["policy_version"] == 7).all()
    assert (td["group_id"][:3] == td["group_id"][0]).all() and td["group_id"][3] != td["group_id"][0]
    # routing: [sum_resp, L, k], valid expert ids
    re_ = td["routed_experts"]
    assert re_.dtype == torch.int16 and re_.shape == (n_resp, cfg.model.num_layers, cfg.model.experts_per_token)
    assert int(re_.min()) >= 0 and int(re_.max()) < cfg.model.num_experts


def test_recorded_routing_equals_teacher_forced_routing():
    """The ids captured during generation are what a full forward of prompt+response routes
    at the position that predicts each response token (the alignment routing replay needs)."""
    cfg = _cfg()
    model, tok = build_model(cfg.model, seed=0)
    engine = HFEngine(model, tok, record_routing=True)
    prompts = [tok.encode("1234=", add_special_tokens=False), tok.encode("98=", add_special_tokens=False)]
    torch.manual_seed(0)
    gen = engine.generate(prompts, max_new_tokens=5, temperature=1.0)
    k = cfg.model.experts_per_token
    for p, toks, routed in zip(prompts, gen.tokens, gen.routed_experts):
        seq = torch.tensor([p + toks])
        out = model(input_ids=seq, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):  # [T, E] per layer
            want = logits.topk(k, -1).indices[len(p) - 1: len(p) - 1 + len(toks)]
            assert torch.equal(want.sort(-1).values, routed[:, layer].long().sort(-1).values)


def test_generation_logprobs_match_teacher_forced_hf():
    cfg = _cfg()
    model, tok = build_model(cfg.model, seed=0)
    engine = HFEngine(model, tok)
    prompts = [tok.encode("5555=", add_special_tokens=False)] * 3
    gen = engine.generate(prompts, max_new_tokens=6, temperature=0.8)
    seqs = [p + t for p, t in zip(prompts, gen.tokens)]
    for s, lp, p in zip(seqs, gen.logprobs, prompts):
        logits = model(input_ids=torch.tensor([s])).logits[0, :-1].float() / 0.8
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0][len(p) - 1:]
        assert torch.allclose(torch.tensor(lp), want, atol=1e-4)


def test_parity_metrics_zero_for_identical_and_positive_after_drift():
    cfg = _cfg()
    model, tok = build_model(cfg.model, seed=0)
    a, b = HFEngine(model, tok), HFEngine(build_model(cfg.model, seed=0)[0], tok)
    task = get_task("copy_digits", num_digits=4)
    seqs, starts = probe_set(task, PromptEncoder(tok, False), 4, 0)
    same = mismatch_metrics(a.score(seqs, starts), b.score(seqs, starts))
    assert same["rollout/mismatch_kl"] < 1e-10
    drift = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in b.model.named_parameters()]
    b.load_weights(drift)
    diff = mismatch_metrics(a.score(seqs, starts), b.score(seqs, starts))
    assert diff["rollout/mismatch_kl"] > 1e-4 and diff["rollout/mismatch_logprob_abs_max"] > 1e-2


def test_score_matches_generate_alignment():
    cfg = _cfg()
    model, tok = build_model(cfg.model, seed=0)
    engine = HFEngine(model, tok)
    prompts = [tok.encode("12=", add_special_tokens=False), tok.encode("34567=", add_special_tokens=False)]
    gen = engine.generate(prompts, max_new_tokens=4, temperature=1.0)
    scored = engine.score([p + t for p, t in zip(prompts, gen.tokens)], [len(p) for p in prompts])
    for a, b in zip(scored, gen.logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert list(itertools.chain(*scored))


def test_factory_builds_the_fast_hf_engine():
    """rollout.engine=hf_fast gives the FastHFEngine, sized to one worker batch, same interface."""
    from streamrl.config import load_config
    from streamrl.engines.factory import build_engine
    from streamrl.engines.hf_fast import FastHFEngine

    cfg = load_config(None, ["rollout.engine=hf_fast", "rollout.group_size=2", "rollout.prompts_per_batch=3"])
    engine = build_engine(cfg)
    assert isinstance(engine, FastHFEngine)
    gen = engine.generate([[5, 6, 7, 14]] * 6, max_new_tokens=3, temperature=1.0)
    assert len(gen.tokens) == 6 and all(len(t) == len(lp) for t, lp in zip(gen.tokens, gen.logprobs))


def test_truncated_responses_score_zero_and_are_counted(repo, monkeypatch):
    """With the task's rule on, a response that ran to max_new_tokens without EOS scores 0 even when
    the task would pay it; the share of truncated responses is reported either way."""
    monkeypatch.chdir(repo)
    register_reward("pays_one")(lambda problem, response: 1.0)
    cfg = _cfg("rollout.rewards=pays_one=1.0")  # the tiny model never emits EOS in 5 tokens
    model, tok = build_model(cfg.model, seed=0)
    engine = build_engine(cfg, model, tok)
    task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
    paid = build_roller(cfg, engine, tok, problem_stream(task, 0, 0, 1), worker_id=0)
    td = paid.rollout_batch(version=0)
    lens = td["response_lens"]
    assert (lens == cfg.rollout.max_new_tokens).all()
    assert paid.last_metrics["rollout/truncated"] == 1.0 and (td["reward"] == 1).all()
    task.truncated_scores_zero = True
    zeroed = build_roller(cfg, engine, tok, problem_stream(task, 0, 0, 1), worker_id=0, task=task)
    td = zeroed.rollout_batch(version=0)
    assert zeroed.last_metrics["rollout/truncated"] == 1.0
    assert (td["reward"] == 0).all()
