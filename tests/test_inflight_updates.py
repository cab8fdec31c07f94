"""In-flight weight updates: a version switch between decode steps, stamped per token.

The update changes only ``lm_head.weight``: K/V never depend on it, so after a switch at step
k every token is exactly what teacher forcing gives under v0 (tokens < k) or v1 (tokens >= k).
Engine level for hf_fast (default tier) and vllm (marker ``vllm``); worker level with real
Redis, a real weights publisher and the learner's staleness buffer.
"""
from __future__ import annotations

import argparse
import copy
import threading
import time

import pytest
import torch

from streamrl.config import ModelConfig, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.buffer import StalenessBuffer
from streamrl.models.factory import build_model, save_model
from streamrl.trajectory import validate_trajectories

TOL = 1e-4
TEMP = 0.9
SWITCH = 4  # between_steps call that returns the update = number of v0 tokens


def _new_head(model, seed: int = 5) -> list[tuple[str, torch.Tensor]]:
    """All weights of ``model`` with a perturbed ``lm_head.weight`` (nothing KV depends on)."""
    assert not model.config.tie_word_embeddings, "the test needs an lm_head that is not the embedding"
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in model.named_parameters():
        t = p.detach().clone()
        if n == "lm_head.weight":
            t += 0.5 * torch.randn(t.shape, generator=g)
        out.append((n, t))
    return out


def _switch_at(k: int, version: int, tensors):
    calls = []

    def between_steps():
        calls.append(len(calls))
        return (version, tensors) if len(calls) - 1 == k else None
    return between_steps, calls


@torch.no_grad()
def _tf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Tempered log-probs of ``response`` teacher-forced after ``prompt``: [len(response)]."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response)].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _check_switch(gen, prompts, v0_model, v1_model, k: int, v0: int, v1: int) -> float:
    """Versions are [v0]*k + [v1]*rest and every log-prob matches its version's teacher forcing."""
    worst = 0.0
    for p, toks, lps, vs in zip(prompts, gen.tokens, gen.logprobs, gen.versions):
        assert len(toks) > k, "the sequence ended before the switch; the test needs longer ones"
        assert vs == [v0] * k + [v1] * (len(toks) - k)
        want = torch.cat([_tf_logprobs(v0_model, p, toks, TEMP)[:k], _tf_logprobs(v1_model, p, toks, TEMP)[k:]])
        other = torch.cat([_tf_logprobs(v1_model, p, toks, TEMP)[:k], _tf_logprobs(v0_model, p, toks, TEMP)[k:]])
        d = (torch.tensor(lps) - want).abs().max().item()
        assert (torch.tensor(lps) - other).abs().max().item() > 1e-2, "the update did not change log-probs"
        worst = max(worst, d)
    assert worst < TOL, f"behaviour log-probs differ from the per-version teacher forcing by {worst:.2e}"
    return worst


# -- hf_fast (default tier) -----------------------------------------------------------------
@pytest.mark.timeout(120)
def test_hf_fast_switch_mid_generation_stamps_tokens_and_uses_new_head():
    from streamrl.engines.hf_fast import FastHFEngine
    from streamrl.engines.hf_fast_config import FastHFConfig

    model, tok = build_model(ModelConfig(), seed=1)
    v0_model = copy.deepcopy(model).eval()
    update = _new_head(model)
    v1_model = copy.deepcopy(model).eval()
    v1_model.load_state_dict(dict(update))
    # eos_token_id=-1: never stops early, so every row spans the switch
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=4, max_seq_len=48, sync_every=3, eos_token_id=-1))
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("1234=", "98=", "55555=", "7=")]
    torch.manual_seed(0)
    cb, calls = _switch_at(SWITCH, 11, update)
    gen = eng.generate(prompts, 12, TEMP, between_steps=cb, version=10)
    assert len(calls) == 12  # before the prefill and before each of the 11 decode steps
    _check_switch(gen, prompts, v0_model, v1_model, SWITCH, 10, 11)
    # a callback that never updates: one version throughout; without a callback: no versions
    cb, _ = _switch_at(-1, 0, None)
    gen = eng.generate(prompts, 5, TEMP, between_steps=cb, version=11)
    assert gen.versions == [[11] * 5] * 4
    assert eng.generate(prompts, 5, TEMP).versions is None


@pytest.mark.timeout(300)
def test_hf_fast_long_generation_spans_several_versions_exactly():
    """160-token responses, slots refilled mid-run, an update every 32 decode steps: every token
    carries the version that sampled it and its log-prob is that version's teacher forcing."""
    from streamrl.engines.hf_fast import FastHFEngine
    from streamrl.engines.hf_fast_config import FastHFConfig

    model, tok = build_model(ModelConfig(), seed=2)
    heads = {0: [(n, p.detach().clone()) for n, p in model.named_parameters()]}
    heads.update({v: _new_head(model, seed=100 + v) for v in range(1, 12)})
    every, new_tokens = 32, 160
    calls = []

    def between_steps():
        calls.append(None)
        c = len(calls) - 1
        return (c // every, heads[c // every]) if c and c % every == 0 else None

    prompts = [tok.encode(t, add_special_tokens=False) for t in ("1234=", "98=", "55555=", "7=", "31=")]
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=4, max_seq_len=180, sync_every=7, eos_token_id=-1))
    torch.manual_seed(0)
    gen = eng.generate(prompts, new_tokens, TEMP, between_steps=between_steps, version=0)
    base = model.model  # K/V and hidden states do not depend on lm_head: one forward per response
    spans = []
    for p, toks, lps, vs in zip(prompts, gen.tokens, gen.logprobs, gen.versions):
        assert len(toks) == len(vs) == new_tokens
        assert vs == sorted(vs)  # versions only move forward within a response
        with torch.no_grad():
            hidden = base(input_ids=torch.tensor([p + toks])).last_hidden_state[0, len(p) - 1: len(p) - 1 + len(toks)]
        want = torch.empty(len(toks))
        for v in set(vs):
            at = torch.tensor([i for i, x in enumerate(vs) if x == v])
            head = dict(heads[v])["lm_head.weight"]
            lp = torch.log_softmax(hidden[at] @ head.T / TEMP, -1)
            want[at] = lp.gather(-1, torch.tensor(toks)[at][:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), want, atol=TOL, rtol=0)
        spans.append(len(set(vs)))
    # 160 tokens at one update per 32 steps: every response spans 5 or 6 versions (a refilled
    # slot starts mid-interval), and the refilled response starts at a later version
    assert all(5 <= n <= 6 for n in spans), spans
    assert gen.versions[4][0] >= 4


def test_inflight_updates_config_refused_for_plain_hf():
    from streamrl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.inflight_updates"):
        load_config("configs/tiny.yaml", ["rollout.inflight_updates=true"])
    cfg = load_config("configs/tiny.yaml", ["rollout.inflight_updates=true", "rollout.engine=hf_fast"])
    assert cfg.rollout.inflight_updates


# -- worker level: real Redis, real publisher, learner buffer -------------------------------
@pytest.mark.timeout(180)
def test_worker_publish_during_generation_gives_two_version_trajectory(redis_url, run_id, repo, monkeypatch):
    """The learner publishes v1 while the worker is mid-batch; the worker's own callback
    (Redis poll + fetch) picks it up, and the learner's buffer accepts the mixed trajectory."""
    from streamrl.weights.factory import make_publisher
    from streamrl.workers.rollout import INFLIGHT_POLL_S, RolloutWorker

    monkeypatch.chdir(repo)
    cfg = load_config("configs/tiny.yaml", [
        "rollout.engine=hf_fast", "rollout.inflight_updates=true", "rollout.group_size=2",
        "rollout.prompts_per_batch=2", "rollout.max_new_tokens=24", "learner.max_staleness=1"])
    coord = Coordinator(redis_url, run_id)
    coord.put_config(cfg.to_dict())
    learner_model, _ = build_model(cfg.model, seed=cfg.run.seed)
    specs = [(n, p.dtype, tuple(p.shape)) for n, p in learner_model.named_parameters()]
    publisher = make_publisher(coord, run_id, cfg)
    worker = RolloutWorker(argparse.Namespace(redis_url=redis_url, run_id=run_id, worker_id=0, num_workers=1,
                                              device=None))
    worker.engine.eos_id = -1  # the random model may draw EOS; every sequence must span the switch
    try:
        publisher.publish(0, specs, (p.detach() for _, p in learner_model.named_parameters()))
        worker.sync_weights()
        assert worker.subscriber.loaded_version == 0

        published = threading.Event()

        def learner_step():  # the learner's next version: every weight moves
            with torch.no_grad():
                for p in learner_model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            publisher.publish(1, specs, (p.detach() for _, p in learner_model.named_parameters()))
            published.set()

        calls = []

        def between_steps():
            calls.append(None)
            if len(calls) == 3:  # mid-generation: let the learner publish, wait for it
                threading.Thread(target=learner_step, daemon=True).start()
                assert published.wait(60)
                time.sleep(INFLIGHT_POLL_S)  # the worker's poll is due at its next call
            return worker.between_steps()

        worker._last_poll = time.monotonic()  # as if it had just polled: no update before call 3
        td = worker.roller.rollout_batch(0, between_steps)
    finally:
        worker.engine.close()
        worker.metrics.close()
        publisher.close()
    validate_trajectories(td)
    assert worker.subscriber.loaded_version == 1 and worker.inflight_loads == 1
    versions = td["policy_version"]
    assert set(versions.tolist()) == {0, 1}
    lens = td["response_lens"].tolist()
    for seq in torch.split(versions, lens):  # each trajectory: v0 tokens, then v1 tokens
        assert seq.tolist() == [0] * 2 + [1] * (len(seq) - 2)
    buf = StalenessBuffer(cfg.rollout.group_size, cfg.learner.max_staleness)
    buf.add(td)
    batch = buf.take(cfg.rollout.prompts_per_batch, version=1)
    assert batch is not None and buf.lag_histogram == {1: len(lens)}  # lag from the oldest token
    strict = StalenessBuffer(cfg.rollout.group_size, max_staleness=0)
    strict.add(td)
    assert strict.drop_stale(1) == cfg.rollout.prompts_per_batch  # mixed v0/v1 counts as v0


# -- vllm -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vllm(tmp_path_factory):
    from streamrl.engines.vllm_engine import VLLMEngine

    model, tok = build_model(ModelConfig(max_positions=256), seed=0)
    folder = tmp_path_factory.mktemp("tiny-moe-inflight")
    save_model(model, tok, folder)
    engine = VLLMEngine(str(folder), dtype="float32", kv_cache_bytes=64 << 20, max_model_len=256, seed=0)
    yield model.eval(), tok, engine
    engine.close()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_switch_mid_generation_stamps_tokens_and_resets_prefix_after(tiny_vllm):
    model, tok, engine = tiny_vllm
    v0_model = copy.deepcopy(model)
    update = _new_head(model)
    v1_model = copy.deepcopy(model)
    v1_model.load_state_dict(dict(update))
    # long prompts (> one 128-token KV block) so the prefix cache holds v0-era blocks
    prompts = [tok.encode("0123456789" * 15 + f"{i}{i + 1}=", add_special_tokens=False) for i in range(4)]
    # no EOS cut: the random model's EOS is rare; min_tokens is not needed when it never comes
    cb, calls = _switch_at(SWITCH, 1, update)
    gen = engine.generate(prompts, 12, TEMP, between_steps=cb, version=0)
    assert all(len(t) == 12 for t in gen.tokens), [len(t) for t in gen.tokens]
    assert len(calls) >= 12
    worst = _check_switch(gen, prompts, v0_model, v1_model, SWITCH, 0, 1)
    print(f"vllm in-flight switch: max |behaviour - teacher forced per version| = {worst:.2e}")
    # The batch is over, so its prefix blocks (computed under v0) must be gone now. The next
    # batch switches every weight before its first step (call 0): a stale prompt block would
    # show as a mismatch against teacher forcing under the new weights.
    g = torch.Generator().manual_seed(9)
    moved = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in v1_model.named_parameters()]
    v2_model = copy.deepcopy(v1_model)
    v2_model.load_state_dict(dict(moved))
    try:
        cb, _ = _switch_at(0, 2, moved)
        after = engine.generate(prompts, 4, TEMP, between_steps=cb, version=1)
        assert after.versions == [[2] * 4] * 4
        for p, toks, lps in zip(prompts, after.tokens, after.logprobs):
            d = (torch.tensor(lps) - _tf_logprobs(v2_model, p, toks, TEMP)).abs().max().item()
            assert d < TOL, f"stale prefix KV after an in-flight update: {d:.2e}"
    finally:
        engine.load_weights(model.named_parameters())
