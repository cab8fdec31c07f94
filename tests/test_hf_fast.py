"""Fast transformers engine: parity with generate(), log-probs, refill, routing, in-place weight updates."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamrl.config import ModelConfig
from streamrl.engines.hf_fast import FastHFEngine, sample_tokens
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.models import build_model

MAX_NEW = 10


def _prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 60, (k,), generator=g).tolist() for k in lens]


def _reference(model, tok, prompt: list[int], max_new: int, eos: int | None = None):
    """Greedy tokens (cut after EOS) and their untempered log-probs from plain generate(), batch 1."""
    eos = tok.eos_token_id if eos is None else eos
    out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id,
                         output_logits=True, return_dict_in_generate=True)
    seq = out.sequences[0, len(prompt):].tolist()
    n = seq.index(eos) + 1 if eos in seq else len(seq)
    logits = torch.stack(out.logits, 1)[0, :n].float()
    lp = F.log_softmax(logits, -1).gather(-1, torch.tensor(seq[:n], device=logits.device)[:, None]).squeeze(-1)
    return seq[:n], lp.cpu()


def _teacher_forced_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits ``[len(response), V]`` of the positions that predicted each response token."""
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(response)]


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_model(ModelConfig(), seed=1)
    return model.eval(), tok


def test_greedy_equals_generate_with_refill(tiny):
    """7 prompts through 3 slots: rows finish at different steps and slots are refilled."""
    model, tok = tiny
    prompts = _prompts(7)
    # The random model rarely draws its EOS: stop on a token one greedy response draws
    # mid-way instead, so rows finish at different steps.
    eos = _reference(model, tok, prompts[0], MAX_NEW)[0][MAX_NEW // 2]
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=3, max_seq_len=32, sync_every=3, eos_token_id=eos))
    got = eng.generate(prompts, MAX_NEW, temperature=0.0)
    lengths = set()
    for i, p in enumerate(prompts):
        ref_tok, ref_lp = _reference(model, tok, p, MAX_NEW, eos)
        assert got.tokens[i] == ref_tok, i
        torch.testing.assert_close(torch.tensor(got.logprobs[i]), ref_lp, atol=1e-5, rtol=0)
        lengths.add(len(ref_tok))
    assert len(lengths) > 1  # some rows stopped at EOS early, so refill really happened mid-run


def test_sampled_logprobs_match_teacher_forced(tiny):
    """Temperature and top-k: each log-prob is that of the truncated, tempered distribution."""
    model, tok = tiny
    prompts = _prompts(4, seed=1)
    for top_k, temp in ((0, 0.7), (5, 1.3)):
        torch.manual_seed(0)
        eng = FastHFEngine(model, tok, FastHFConfig(batch_size=4, max_seq_len=32, top_k=top_k))
        got = eng.generate(prompts, MAX_NEW, temperature=temp)
        for p, resp, lp in zip(prompts, got.tokens, got.logprobs):
            z = _teacher_forced_logits(model, p, resp) / temp
            if top_k:
                z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], float("-inf"))
            ref = F.log_softmax(z, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
            assert torch.isfinite(ref).all()  # every drawn token is inside the top-k set
            torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=0)


def test_sampler_top_p_and_distribution():
    """Top-p keeps the smallest prefix with mass >= p; draws follow the renormalised distribution."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    tok, lp = sample_tokens(logits, torch.ones(1), top_p=0.8)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    assert freq[2:].sum() == 0  # 0.5 + 0.3 reaches 0.8: the tail is cut
    torch.testing.assert_close(freq[:2], torch.tensor([0.625, 0.375]), atol=0.02, rtol=0)
    torch.testing.assert_close(lp[tok == 0][0], torch.tensor(0.625).log())


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9)])
def test_sampler_in_scratch_draws_the_same_tokens_and_logprobs(top_k, top_p):
    """The CPU engine's in-place draw (scratch buffers, logits overwritten) is bit for bit the
    plain one: same random stream, same kernels; fewer rows than the scratch holds too."""
    scratch = torch.empty(2, 8, 300)
    for n in (8, 3):
        logits = torch.randn(n, 300) * 3
        torch.manual_seed(n)
        want = sample_tokens(logits.clone(), torch.tensor([0.7]), top_k, top_p)
        torch.manual_seed(n)
        got = sample_tokens(logits.clone(), torch.tensor([0.7]), top_k, top_p, scratch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_routing_recorded_per_token(tiny):
    model, tok = tiny
    prompts = _prompts(3, seed=2)
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=32, record_routing=True))
    got = eng.generate(prompts, MAX_NEW, temperature=1.0)
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in eng.routers]
    try:
        for p, resp, routed in zip(prompts, got.tokens, got.routed_experts):
            seen.clear()
            _teacher_forced_logits(model, p, resp)
            ref = torch.stack(seen, 1)[len(p) - 1: len(p) - 1 + len(resp)]  # [n, L, k]
            assert routed.shape == ref.shape and routed.dtype == torch.int16
            assert torch.equal(routed.long().sort(-1).values, ref.sort(-1).values)
    finally:
        for h in hooks:
            h.remove()


def test_weight_update_in_place_and_no_stale_kv(tiny):
    """Copy new weights into the same storage; the next call uses them and no KV of the old ones."""
    _, tok = tiny
    model_a, _ = build_model(ModelConfig(), seed=1)
    model_b, _ = build_model(ModelConfig(), seed=2)
    eng = FastHFEngine(model_a, tok, FastHFConfig(batch_size=3, max_seq_len=40))
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    long_prompts = _prompts(3, seed=3, lo=20, hi=28)   # fill many cache positions with A's K/V
    short_prompts = _prompts(3, seed=4, lo=3, hi=6)
    before = eng.generate(long_prompts, MAX_NEW, temperature=0.0)
    eng.load_weights(model_b.named_parameters())
    after = eng.generate(short_prompts, MAX_NEW, temperature=0.0)
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptrs
    fresh = FastHFEngine(model_b, tok, FastHFConfig(batch_size=3, max_seq_len=40)).generate(short_prompts, MAX_NEW, 0.0)
    assert after.tokens == fresh.tokens
    torch.testing.assert_close(torch.tensor(sum(after.logprobs, [])), torch.tensor(sum(fresh.logprobs, [])),
                               atol=1e-6, rtol=0)
    for p, t in zip(short_prompts, after.tokens):
        assert t == _reference(model_b, tok, p, MAX_NEW)[0]
    assert before.tokens != eng.generate(long_prompts, MAX_NEW, 0.0).tokens  # the update changed the policy


def test_bad_updates_and_inputs_raise_without_side_effects(tiny):
    model, tok = tiny
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=16))
    snapshot = {n: p.clone() for n, p in eng.model.named_parameters()}
    items = [(n, torch.zeros_like(p)) for n, p in eng.model.named_parameters()]
    with pytest.raises(KeyError):
        eng.load_weights(items[:-1])
    bad = list(items)
    bad[-1] = (bad[-1][0], torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        eng.load_weights(bad)
    for n, p in eng.model.named_parameters():
        assert torch.equal(p, snapshot[n]), n
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate([[5] * 10], 10, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([[5]], 2, -1.0)
    with pytest.raises(ValueError, match="batch_size"):
        FastHFEngine(model, tok, FastHFConfig(batch_size=0))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_shared_prompt_groups_equal_separate_prefills(tiny, temperature):
    """Groups of 4 over 5 slots (groups split across refills): forking one prefill's K/V gives the
    tokens and log-probs of prefilling every copy, with fewer prompt tokens run."""
    model, tok = tiny
    groups = _prompts(3, seed=6, lo=4, hi=14)
    prompts = [p for p in groups for _ in range(4)]
    runs = {}
    for share in (True, False):
        eng = FastHFEngine(model, tok, FastHFConfig(batch_size=5, max_seq_len=40, share_prompts=share, sync_every=2))
        torch.manual_seed(0)
        runs[share] = (eng.generate(prompts, MAX_NEW, temperature=temperature), eng.prefill_tokens)
    (shared, n_shared), (separate, n_separate) = runs[True], runs[False]
    assert shared.tokens == separate.tokens
    torch.testing.assert_close(torch.tensor(sum(shared.logprobs, [])), torch.tensor(sum(separate.logprobs, [])),
                               atol=1e-5, rtol=0)
    assert n_separate == sum(len(p) for p in prompts)
    # each refill runs a distinct prompt once; a group split over two refills runs twice. How groups
    # split depends on when rows end, i.e. on the sampled tokens: the 0.6 bound holds for the
    # (deterministic) greedy rows; sampled rows must still run fewer prompt tokens.
    assert sum(len(p) for p in groups) <= n_shared <= n_separate * (0.6 if temperature == 0 else 0.99)
    if temperature:
        assert len({tuple(t) for t in shared.tokens[:4]}) > 1  # the group's samples differ after the fork


def test_per_request_caps_and_stop_strings(tiny):
    """Caps per prompt and stop strings cut greedy responses exactly where they should; the
    tokens and log-probs kept are those of the uncut run (cut rows free their slots early)."""
    model, tok = tiny
    prompts = _prompts(5, seed=7)
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=48, sync_every=3, eos_token_id=-1))
    full = eng.generate(prompts, 20, 0.0)
    caps = [3, 20, 1, 9, 14]
    capped = eng.generate(prompts, 20, 0.0, max_tokens=caps)
    assert [len(t) for t in capped.tokens] == caps
    for c, f, n in zip(capped.tokens, full.tokens, caps):
        assert c == f[:n]
    text = tok.decode(full.tokens[1])
    stop = text[11:13]  # a string response 1 reaches after ~12 tokens
    cut = eng.generate(prompts, 20, 0.0, stop=[stop])
    for c, lp, f, flp in zip(cut.tokens, cut.logprobs, full.tokens, full.logprobs):
        n = next((k for k in range(1, len(f) + 1) if stop in tok.decode(f[:k])), len(f))
        assert c == f[:n] and lp == pytest.approx(flp[:n], abs=1e-6)
    assert len(cut.tokens[1]) <= 13
    with pytest.raises(ValueError, match="max_tokens"):
        eng.generate(prompts, 5, 0.0, max_tokens=[1, 2])
    with pytest.raises(ValueError, match="stop"):
        FastHFEngine(model, None, FastHFConfig(batch_size=2, max_seq_len=48)).generate(prompts, 5, 0.0, stop=["x"])


def test_bench_reports_ratio():
    from streamrl.bench.hf_fast import bench_fast_vs_generate

    res = bench_fast_vs_generate(batch=4, prompt_len=6, new_tokens=8)
    assert res["fast_tokens"] == res["generate_tokens"] == 4 * 8
    assert res["ratio_vs_plain_generate"] > 0 and res["params_active"] < res["params_total"]


@pytest.mark.parametrize("name, want", [("NVIDIA H200", 4.8), ("NVIDIA H100 80GB HBM3", 3.35),
                                        ("NVIDIA H100 PCIe", 2.0), ("NVIDIA H100 NVL", 3.9), ("Tesla T4", None)])
def test_bandwidth_floor_uses_the_cards_own_bandwidth(name, want):
    from streamrl.bench.hf_fast import spec_bandwidth_tb_s

    assert spec_bandwidth_tb_s(name) == want


def test_group_bench_shares_prefill_and_matches_generate(tiny):
    from streamrl.bench.hf_fast import bench_groups

    model, tok = tiny
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=6, max_seq_len=40))
    res = bench_groups(eng, _prompts(2, seed=8), group_size=3, new_tokens=6, repeats=1)
    assert res["greedy_tokens_equal"] and res["greedy_sequences_equal"] == "6/6"
    assert res["prompt_tokens_prefilled"] * 3 == res["prompt_tokens"]
    assert res["fast_tok_s"] > 0 and res["plain_generate_tok_s"] > 0
    assert eng.eos_id == tok.eos_token_id  # the bench put the engine's EOS back


# ------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("decode_attention", ["sdpa", "flex"])
def test_gpu_graphs_parity_and_update_without_recapture(decode_attention):
    model_a, tok = build_model(ModelConfig(), seed=1)
    model_b, _ = build_model(ModelConfig(), seed=2)
    model_b = model_b.cuda()
    eng = FastHFEngine(model_a, tok, FastHFConfig(device="cuda", batch_size=3, max_seq_len=40, span_bucket=16,
                       record_routing=True, decode_attention=decode_attention))
    prompts = _prompts(7)
    got = eng.generate(prompts, MAX_NEW, temperature=0.0)
    assert eng.captures > 0
    for i, p in enumerate(prompts):
        ref_tok, ref_lp = _reference(eng.model, tok, p, MAX_NEW)
        assert got.tokens[i] == ref_tok, i
        torch.testing.assert_close(torch.tensor(got.logprobs[i]), ref_lp, atol=1e-4, rtol=0)
    captures = eng.captures
    eng.load_weights(model_b.named_parameters())
    after = eng.generate(prompts, MAX_NEW, temperature=0.0)
    assert eng.captures == captures  # same graphs, new weights
    for i, p in enumerate(prompts):
        assert after.tokens[i] == _reference(model_b, tok, p, MAX_NEW)[0], i
    sampled = eng.generate(prompts, MAX_NEW, temperature=0.8)
    for p, resp, lp in zip(prompts, sampled.tokens, sampled.logprobs):
        ref = F.log_softmax(_teacher_forced_logits(model_b, p, resp) / 0.8, -1)
        ref = ref.gather(-1, torch.tensor(resp, device="cuda")[:, None]).squeeze(-1).cpu()
        torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_decode_traces_one_graph_for_every_layer(tiny):
    """The compiled step (what CUDA graphs capture) compiles the decoder layer once for all layers, and
    its tail once, without graph breaks (each layer's K/V and routing buffers are handed over outside
    the layer); it decodes the tokens and records the routing of the plain step."""
    from torch._dynamo.utils import counters

    model, tok = tiny
    assert len(model.model.layers) >= 2  # a graph per layer would show as more graphs
    prompts = _prompts(3, seed=5)
    config = FastHFConfig(batch_size=2, max_seq_len=32, record_routing=True)
    ref = FastHFEngine(model, tok, config).generate(prompts, 8, 0.0)
    torch._dynamo.reset()
    counters.clear()
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=32, record_routing=True))
    eng._compile_decode()
    got = eng.generate(prompts, 8, 0.0)
    # the layer: one graph with the first span, one with the span symbolic; the tail: one
    assert counters["stats"]["unique_graphs"] <= 3 and not counters["graph_break"]
    assert got.tokens == ref.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.routed_experts, ref.routed_experts))


@pytest.mark.slow
def test_compiled_decode_step_compiles_at_most_twice_over_spans(tiny):
    """The compiled decode step (what CUDA graphs capture, once per span bucket) recompiles its layer
    once with the span symbolic, not once per bucket, and decodes what the plain step decodes."""
    from torch._dynamo.utils import counters

    model, tok = tiny
    prompts = _prompts(2, seed=7)
    spans = [16, 24, 32, 40]

    def decode(compiled: bool) -> list[torch.Tensor]:
        eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=48, compile=compiled))
        if compiled:
            eng._compile_decode()
        with torch.no_grad(), eng._impl():
            eng.max_new.fill_(len(spans))
            eng.prefill([0, 1], prompts, True)
            for span in spans:
                eng._decode(span, True)
        return [eng.out_tok.clone(), eng.out_lp.clone()]

    torch._dynamo.reset()
    counters.clear()
    got = decode(True)
    assert counters["stats"]["unique_graphs"] <= 3  # the layer's two (static, then the span symbolic), the tail's
    ref = decode(False)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)


def test_eager_steps_run_only_the_live_rows(tiny):
    """Rows that finished wait for the next sync; meanwhile eager (CPU) steps leave them out.
    Tokens, log-probs and recorded routes stay those of each prompt on its own."""
    model, tok = tiny
    prompts = _prompts(4, seed=3)
    caps = [2, MAX_NEW, 5, MAX_NEW]
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=4, max_seq_len=32, sync_every=MAX_NEW, eos_token_id=-1,
                       record_routing=True))
    stepped: list[int] = []
    layers = eng._layers
    eng._layers = lambda x, mask, pos_ids: (stepped.append(x.shape[0]), layers(x, mask, pos_ids))[1]
    got = eng.generate(prompts, MAX_NEW, temperature=0.0, max_tokens=caps)
    decode = stepped[-(MAX_NEW - 1):]  # after the prefill: one decode step per token after the first
    assert decode == [4, 3, 3, 3, 2, 2, 2, 2, 2], stepped
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in eng.routers]
    try:
        for p, cap, resp, lp, routed in zip(prompts, caps, got.tokens, got.logprobs, got.routed_experts):
            ref_tok, ref_lp = _reference(model, tok, p, cap, eos=-1)
            assert resp == ref_tok
            torch.testing.assert_close(torch.tensor(lp), ref_lp, atol=1e-5, rtol=0)
            seen.clear()
            _teacher_forced_logits(model, p, resp)
            ref = torch.stack(seen, 1)[len(p) - 1: len(p) - 1 + len(resp)]
            assert torch.equal(routed.long().sort(-1).values, ref.sort(-1).values)
    finally:
        for h in hooks:
            h.remove()
