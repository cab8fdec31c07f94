"""Packed, padding-free micro-batches train exactly like today's padded full-vocabulary step.

The reference is :func:`streamrl.bench.padded_reference.padded_step` (one padded forward,
``log_softmax`` over ``[B, T, V]``); the packed step is :func:`~streamrl.bench.padded_reference.packed_gradients` /
:meth:`Trainer.step`. Compared: loss and other metrics, per-token log-probs, and every
parameter's gradient, on 1 rank, 2 FSDP ranks and 2 FSDP ranks with ep = 2 (tiny Qwen3-MoE).
"""
from __future__ import annotations

import pytest
import torch

from streamrl.bench.padded_reference import packed_gradients, padded_forward, padded_step
from streamrl.config import load_config
from streamrl.learner.logprobs import token_logprobs, token_logprobs_chunked
from streamrl.learner.packing import build_microbatch, plan_microbatches, TrajectoryView
from streamrl.learner.trainer import Trainer
from streamrl.parallel.expert_parallel import full_parameter
from streamrl.trajectory import pack_trajectories, to_padded

from tests.dist_helpers import spawn_gloo

from test_checkpoint import REPO

# The load-balancing loss pools its statistics per micro-batch (as Megatron-LM does), so it
# is exact only with one micro-batch: tests with small budgets turn it off.
BASE = ["learner.lr=1e-3", "learner.z_loss_coef=0.01", "learner.routing_replay=true"]


def group_batch(seed: int, groups: int = 3, g: int = 4, layers: int = 2, k: int = 2, experts: int = 4):
    """``groups`` x ``g`` trajectories; a group's samples share one prompt; with R3 expert ids
    on most samples (one sample per group routes by itself)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, resp, routed = [], [], []
    for gi in range(groups):
        prompt = [1] + torch.randint(3, 20, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen).tolist()
        for s in range(g):
            r = torch.randint(3, 20, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
            prompts.append(prompt)
            resp.append(r)
            ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(len(r) * layers)])
            routed.append(ids.reshape(len(r), layers, k) if s else torch.zeros(len(r), layers, k, dtype=torch.int64))
    n = len(prompts)
    lps = [(-torch.rand(len(r), generator=gen) * 2).tolist() for r in resp]
    return pack_trajectories(prompts, resp, lps, [[0] * len(r) for r in resp], torch.rand(n, generator=gen).tolist(),
                             [i // g for i in range(n)], list(range(n)), 0, 0.0, routed_experts=routed)


def _trainer(extra=()):
    return Trainer(load_config(f"{REPO}/configs/tiny.yaml", [*BASE, *extra]))


def _full_grads(tr) -> dict[str, torch.Tensor]:
    return {n: full_parameter(n, p.grad, tr.mesh).clone() for n, p in tr.model.named_parameters() if p.grad is not None}


def _packed_vs_padded(rank, world, ep, extra):
    batch = group_batch(3)
    tr = _trainer([f"learner.ep={ep}", *extra])
    ref_m = padded_step(tr, batch, optimizer_step=False)
    ref_g = _full_grads(tr)
    m = packed_gradients(tr, batch)
    g = _full_grads(tr)
    keys = [k for k in ("learner/loss", "learner/entropy", "moe/aux_loss", "moe/z_loss", "moe/router_entropy")
            if k in ref_m and not (k == "moe/aux_loss" and "learner.aux_loss_coef=0" in extra)]
    return {"ref_m": {k: ref_m[k] for k in keys}, "m": {k: m[k] for k in keys}, "ref_g": ref_g, "g": g}


def _assert_same(out, atol=2e-6):
    for k, v in out["ref_m"].items():
        assert out["m"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert out["g"].keys() == out["ref_g"].keys()
    for k, v in out["ref_g"].items():
        assert torch.allclose(out["g"][k], v, atol=atol, rtol=1e-4), (k, (out["g"][k] - v).abs().max())


@pytest.mark.parametrize("extra", [
    ["learner.shared_prompt=false"],  # one micro-batch, each sample with its own prompt
    [],  # the default: shared prompts
    ["learner.max_tokens_per_microbatch=24", "learner.aux_loss_coef=0", "learner.shared_prompt=true",
     "learner.logprob_chunk_tokens=3"],
    ["learner.kl_coef=0.1", "learner.entropy_coef=0.01", "learner.max_tokens_per_microbatch=16",
     "learner.aux_loss_coef=0", "learner.agg=seq-mean-token-mean"],
    ["learner.loss=gspo", "learner.agg=seq-mean-token-sum-norm", "learner.shared_prompt=true"],
])
def test_packed_equals_padded_one_rank(extra):
    out = _packed_vs_padded(0, 1, 1, extra)
    assert out["ref_g"], "no gradients"
    _assert_same(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ep", [1, 2])
def test_packed_equals_padded_two_ranks(ep):
    extra = ["learner.shared_prompt=true", "learner.max_tokens_per_microbatch=30", "learner.aux_loss_coef=0"]
    outs = spawn_gloo(_packed_vs_padded, 2, ep, extra, timeout_s=120)
    one = _packed_vs_padded(0, 1, 1, extra)
    for o in outs:
        _assert_same(o)
        for k, v in one["ref_g"].items():  # and the 2-rank gradient is the 1-rank one
            assert torch.allclose(o["g"][k], v, atol=2e-6, rtol=1e-4), k


def test_microbatch_layout_and_logprobs():
    """Shared-prompt rows: the prompt once, each sample with its own last prompt token; the
    packed log-probs are the padded ones at the response positions."""
    batch = group_batch(5, groups=2, g=3)
    view = TrajectoryView(batch)
    plan = plan_microbatches(batch, list(range(6)), budget=10_000, shared=True, view=view)
    assert [[len(u) for u in units] for units in plan] == [[3, 3]]
    mb = build_microbatch(view, plan[0], shared=True)
    p = batch["prompt_lens"].tolist()
    r = batch["response_lens"].tolist()
    assert mb.num_tokens == sum(p[i * 3] - 1 + sum(r[i * 3 + s] + 1 for s in range(3)) for i in range(2))
    assert mb.attention_mask.shape == (1, 1, mb.num_tokens, mb.num_tokens)
    tr = _trainer()
    tr.model.eval()
    with torch.no_grad():
        logp = tr._run(tr.model, mb, grid_width=max(r))[0]
        pad = to_padded(batch, tr.pad_id)
        logits, _ = padded_forward(tr, tr.model, pad["input_ids"], pad["attention_mask"])
        full = token_logprobs(logits, pad["input_ids"], 1.0)
    for i in range(6):
        assert torch.allclose(logp[i, : r[i]], full[i, p[i] - 1 : p[i] - 1 + r[i]], atol=1e-5)
    # a budget smaller than a group splits it; a sequence is never split
    small = plan_microbatches(batch, list(range(6)), budget=1, shared=True, view=view)
    assert [i for units in small for u in units for i in u] == list(range(6))
    assert all(len(units) == 1 and len(units[0]) == 1 for units in small)


@pytest.mark.parametrize("temperature,chunk,bias,grads", [
    (1.0, 4, False, "both"), (0.7, 5, True, "both"), (1.3, 100, False, "both"),
    # one chunk (its logits kept and overwritten by the backward), with each gradient term alone
    (1.0, 100, True, "both"), (1.0, 100, False, "logp"), (1.0, 100, False, "entropy"), (0.7, 4, True, "logp")])
def test_chunked_logprobs_equal_full(temperature, chunk, bias, grads, monkeypatch):
    """Values and gradients (hidden, weight, bias) of log-probs and entropy equal the full-vocab form
    (the eager forward's reductions in blocks of 3 rows)."""
    monkeypatch.setattr("streamrl.learner.logprobs._STATS_BLOCK_BYTES", 3 * 4 * 50)
    g = torch.Generator().manual_seed(0)
    n, h, v = 13, 8, 50
    hid = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    tgt = torch.randint(0, v, (n,), generator=g)
    c1, c2 = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    c1, c2 = (c1 * (grads != "entropy"), c2 * (grads != "logp"))
    lp, ent = token_logprobs_chunked(hid, w, tgt, temperature, chunk, with_entropy=grads != "logp", bias=b)
    (((lp * c1).sum() if grads != "entropy" else 0) + ((ent * c2).sum() if grads != "logp" else 0)).backward()
    got = [hid.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if bias else [])
    for t in [hid, w] + ([b] if bias else []):
        t.grad = None
    z = (hid @ w.t() + (b if bias else 0)) / temperature
    full = torch.log_softmax(z, -1)
    lp_ref = full.gather(-1, tgt[:, None]).squeeze(-1)
    ent_ref = -(full.exp() * full).sum(-1)
    ((lp_ref * c1).sum() + (ent_ref * c2).sum()).backward()
    want = [hid.grad, w.grad] + ([b.grad] if bias else [])
    assert torch.allclose(lp.double(), lp_ref, atol=1e-6)
    assert torch.allclose(ent.double(), ent_ref, atol=1e-6) if grads != "logp" else not ent.any()
    for a, e in zip(got, want):
        assert torch.allclose(a, e, atol=1e-6)


def test_chunked_logprobs_two_graphs_before_backward():
    """Two one-chunk forwards before either backward: the second may not reuse the first's kept
    logits (the CPU workspace is lent to one graph at a time); both gradients stay exact, and a
    third forward after the backwards reuses the workspace."""
    from streamrl.learner import logprobs

    g = torch.Generator().manual_seed(1)
    n, h, v = 6, 8, 40
    w = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    hs = [torch.randn(n, h, generator=g, dtype=torch.float64) for _ in range(2)]
    tg = [torch.randint(0, v, (n,), generator=g) for _ in range(2)]
    loss = sum(token_logprobs_chunked(x, w, t, 1.0, 100)[0].sum() for x, t in zip(hs, tg))
    loss.backward()
    ref = sum(torch.log_softmax(x @ w.t(), -1).gather(-1, t[:, None]).sum() for x, t in zip(hs, tg))
    (want,) = torch.autograd.grad(ref, w)
    assert torch.allclose(w.grad, want, atol=1e-10)
    buf = logprobs._LOGITS_WORKSPACE.buf
    token_logprobs_chunked(hs[0], w, tg[0], 1.0, 100)[0].sum().backward()
    assert logprobs._LOGITS_WORKSPACE.buf is buf


def test_microbatches_match_one_microbatch_vtrace():
    """Many micro-batches give the one-micro-batch gradient for the V-trace critic too (its
    targets and advantage whitening are computed over the whole minibatch)."""
    batch = group_batch(9)
    for extra in (["learner.loss=vtrace"],):
        grads = []
        for budget in (10_000, 12):
            tr = _trainer([*extra, "learner.aux_loss_coef=0", f"learner.max_tokens_per_microbatch={budget}",
                           "learner.shared_prompt=true"])
            packed_gradients(tr, batch)
            grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for k, v in grads[0].items():
            assert torch.allclose(grads[1][k], v, atol=1e-7, rtol=1e-4), (extra, k)


@pytest.mark.slow
def test_step_minibatches_with_microbatches():
    """A full step with minibatches = 2 (proximal log-probs from a pre-pass) lands on the same
    weights whatever the micro-batch budget."""
    batch = group_batch(9)
    params = []
    for budget in (10_000, 12):
        tr = _trainer(["learner.minibatches=2", "learner.aux_loss_coef=0", f"learner.max_tokens_per_microbatch={budget}"])
        tr.step(batch)
        params.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})
    for k, v in params[0].items():
        # Adam's first steps are ~lr * sign(g): 1e-4 (lr = 1e-3) would catch any flipped sign
        assert torch.allclose(params[1][k], v, atol=1e-4), k


def _grads_with_and_without_checkpointing(rank, world, ep, extra):
    batch = group_batch(4)
    out = []
    for ac in ("false", "true"):
        tr = _trainer([f"learner.ep={ep}", f"learner.activation_checkpointing={ac}", *extra])
        m = packed_gradients(tr, batch)
        out.append({"loss": m["learner/loss"], "g": _full_grads(tr)})
    return out


@pytest.mark.parametrize("extra", [
    ["learner.shared_prompt=true", "learner.max_tokens_per_microbatch=30", "learner.aux_loss_coef=0"],
    pytest.param(["learner.compile=true"], marks=[pytest.mark.heavy, pytest.mark.timeout(900)]),  # compiling: minutes
])
def test_activation_checkpointing_leaves_gradients_unchanged(extra):
    """Per-layer checkpointing (with R3 replay restored for the recompute; and composed with
    compiled layers) gives the same loss and gradients."""
    plain, ac = _grads_with_and_without_checkpointing(0, 1, 1, extra)
    assert ac["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    for k, v in plain["g"].items():
        assert torch.allclose(ac["g"][k], v, atol=1e-7, rtol=1e-5), k


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_activation_checkpointing_with_fsdp_and_ep():
    extra = ["learner.shared_prompt=true", "learner.max_tokens_per_microbatch=30", "learner.aux_loss_coef=0"]
    for plain, ac in spawn_gloo(_grads_with_and_without_checkpointing, 2, 2, extra, timeout_s=300):
        for k, v in plain["g"].items():
            assert torch.allclose(ac["g"][k], v, atol=1e-7, rtol=1e-5), k


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3_moe"])
def test_transformers_builds_the_packed_mask_from_position_ids(arch):
    """The models the learner trains (SmolLM2 = Llama, the upcycled Mixtral, Qwen3-MoE), sdpa:
    two sequences in one row with restarting position ids give each sequence's own logits.
    Only without a KV cache: with ``use_cache`` on (the eval default) transformers skips the
    packed-sequence detection and sequences attend across, so the learner passes
    ``use_cache=False``."""
    import transformers as hf

    kw = dict(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, attn_implementation="sdpa")
    cfg = {"llama": lambda: hf.LlamaConfig(**kw),
           "mixtral": lambda: hf.MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2),
           "qwen3_moe": lambda: hf.Qwen3MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
           }[arch]()
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(cfg).eval()
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), use_cache=False,
                       position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None]).logits
        sep = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
    assert torch.allclose(packed, sep, atol=1e-5)


def test_batch_without_signal_skips_the_optimizer_step():
    """Every group's rewards alike -> all advantages 0 -> no optimizer step (learner.skip_no_signal),
    so the weights and AdamW's state stay as they were; with the flag off the step runs."""
    batch = group_batch(5)
    batch["reward"] = torch.full_like(batch["reward"], 0.5)
    for skip in (True, False):
        tr = _trainer([f"learner.skip_no_signal={str(skip).lower()}"])
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        m = tr.step(batch)
        moved = any(not torch.equal(before[n], p.detach()) for n, p in tr.model.named_parameters())
        assert m["learner/skipped_no_signal"] == float(skip)
        assert moved is not skip and (len(tr.optim.state) == 0) is skip
