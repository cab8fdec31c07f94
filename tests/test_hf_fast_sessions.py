"""Kept sessions of the fast engine (multi-turn KV reuse): a turn that resumes a kept sequence gives
exactly the tokens and log-probs of a full re-prefill, prefills only its new tokens, and falls back
to a full prefill when the session was evicted."""
from __future__ import annotations

import pytest
import torch

from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from tests.test_hf_fast import _prompts
from tests.test_hf_fast_paged import _same, tiny  # noqa: F401 - tiny is a module-scoped fixture

NEW = 6
REPLY = [7, 8, 9]  # a "tool reply" appended after each response


def _two_turns(eng, prompts, temperature, sessions=None, seed=0):
    """Turn 1, then turn 2 on prompt + response + REPLY (the episode driver's next prompt)."""
    torch.manual_seed(seed)
    first = eng.generate(prompts, NEW, temperature, sessions=sessions)
    second_prompts = [p + t + REPLY for p, t in zip(prompts, first.tokens)]
    torch.manual_seed(seed + 1)
    return first, second_prompts, eng.generate(second_prompts, NEW, temperature, sessions=sessions)


@pytest.mark.parametrize("kv", ["static", "paged"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resumed_turn_equals_full_reprefill_and_prefills_only_new_tokens(tiny, kv, temperature):
    model, tok = tiny
    prompts = _prompts(5, seed=3, lo=3, hi=14)
    kw = dict(batch_size=6, max_seq_len=48, sync_every=2, kv_cache=kv, block_size=4)
    eos = -1
    if temperature == 0.0:  # greedy: end some rows early on a token a response draws mid-way
        no_eos = FastHFEngine(model, tok, FastHFConfig(**kw, eos_token_id=-1))
        eos = no_eos.generate(prompts, NEW, 0.0).tokens[0][NEW // 2]
    ref = FastHFEngine(model, tok, FastHFConfig(**kw, eos_token_id=eos))
    eng = FastHFEngine(model, tok, FastHFConfig(**kw, eos_token_id=eos))
    r1, ref_prompts, r2 = _two_turns(ref, prompts, temperature)
    ids = [f"ep{i}" for i in range(len(prompts))]
    g1, prompts2, g2 = _two_turns(eng, prompts, temperature, sessions=ids)
    _same(r1, g1)
    assert prompts2 == ref_prompts
    _same(r2, g2, atol=1e-4)
    # Each resumed prompt ran only the reply and the last response token (never fed by decode).
    assert g2.cached_tokens == [len(p) + len(t) - 1 for p, t in zip(prompts, g1.tokens)]
    new_tokens = sum(len(REPLY) + 1 for _ in prompts)
    assert eng.prefill_tokens == ref.prefill_tokens - sum(g2.cached_tokens)
    assert eng.reused_tokens == sum(g2.cached_tokens) and new_tokens == sum(map(len, prompts2)) - eng.reused_tokens
    eng.release(ids)
    assert len(eng.sessions) == 0
    if kv == "paged":
        assert eng.cache.free_blocks == eng.cache.num_blocks - 1


def test_evicted_session_falls_back_to_full_prefill(tiny):
    """Two slots hold two kept sessions; a third sequence needs a slot and evicts the least recent
    one, whose next turn is prefilled in full; both results equal the full re-prefill."""
    model, tok = tiny
    prompts = _prompts(3, seed=4, lo=3, hi=10)
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=48, eos_token_id=-1))
    ref = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=48, eos_token_id=-1))
    first = eng.generate(prompts[:2], NEW, 0.0, sessions=["a", "b"])
    eng.generate([prompts[2]], NEW, 0.0)  # no session: takes the slot of "a" (least recently kept)
    assert "a" not in eng.sessions and "b" in eng.sessions and eng.sessions.evictions == 1
    nxt = [p + t + REPLY for p, t in zip(prompts, first.tokens)]
    got = eng.generate(nxt, NEW, 0.0, sessions=["a", "b"])
    assert got.cached_tokens == [0, len(nxt[1]) - len(REPLY) - 1]
    _same(ref.generate(nxt, NEW, 0.0), got, atol=1e-4)


def test_small_paged_pool_evicts_kept_sessions_before_preempting(tiny):
    """A pool too small for the kept sessions and a new batch: kept blocks are freed first, the
    running sequences are not preempted, and the resumed turns still equal full re-prefills."""
    model, tok = tiny
    prompts = _prompts(4, seed=5, lo=8, hi=12)
    kw = dict(batch_size=4, max_seq_len=40, eos_token_id=-1, kv_cache="paged", block_size=4)
    eng = FastHFEngine(model, tok, FastHFConfig(**kw, kv_blocks=17))
    first = eng.generate(prompts, NEW, 0.0, sessions=list(range(4)))
    held = eng.cache.num_blocks - 1 - eng.cache.free_blocks
    assert held > 0 and len(eng.sessions) == 4
    other = _prompts(4, seed=6, lo=8, hi=12)
    _same(FastHFEngine(model, tok, FastHFConfig(**kw)).generate(other, NEW, 0.0), eng.generate(other, NEW, 0.0))
    assert eng.sessions.evictions > 0 and eng.preemptions == 0
    nxt = [p + t + REPLY for p, t in zip(prompts, first.tokens)]
    got = eng.generate(nxt, NEW, 0.0, sessions=list(range(4)))
    assert 0 in got.cached_tokens  # an evicted session fell back to a full prefill
    _same(FastHFEngine(model, tok, FastHFConfig(**kw)).generate(nxt, NEW, 0.0), got, atol=1e-4)


def test_diverging_prompt_reuses_the_common_prefix_only(tiny):
    """A session whose next prompt drops the end of the kept response (the driver truncates a turn
    to its budget) reuses the common prefix and recomputes the rest."""
    model, tok = tiny
    p = _prompts(1, seed=7, lo=6, hi=7)[0]
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=48, eos_token_id=-1, kv_cache="paged",
                                                block_size=4))
    first = eng.generate([p], NEW, 0.0, sessions=["s"])
    nxt = p + first.tokens[0][:2] + REPLY
    got = eng.generate([nxt], NEW, 0.0, sessions=["s"])
    assert got.cached_tokens == [len(p) + 2]
    full = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=48, eos_token_id=-1))
    _same(full.generate([nxt], NEW, 0.0), got, atol=1e-4)


def test_sessions_validated(tiny):
    model, tok = tiny
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=32))
    for bad in (["a"], ["a", "a"], ["a", None]):
        with pytest.raises(ValueError, match="sessions"):
            eng.generate([[3, 4], [5, 6]], 2, 0.0, sessions=bad)


def test_resuming_inside_a_shared_prompt_block_copies_it(tiny):
    """Two sessions fork one prompt (paged: its full blocks are shared). One resumes with a prompt
    that diverges inside a shared block: that block is copied before it is written, so the other
    session's K/V is intact and its next turn still equals a full re-prefill."""
    model, tok = tiny
    p = _prompts(1, seed=8, lo=9, hi=10)[0]
    kw = dict(batch_size=2, max_seq_len=48, eos_token_id=-1, kv_cache="paged", block_size=4)
    eng, ref = FastHFEngine(model, tok, FastHFConfig(**kw)), FastHFEngine(model, tok, FastHFConfig(**kw))
    first = eng.generate([p, p], NEW, 0.0, sessions=["x", "y"])
    diverged = p[:6] + REPLY
    got_x = eng.generate([diverged], NEW, 0.0, sessions=["x"])
    assert got_x.cached_tokens == [6]
    _same(ref.generate([diverged], NEW, 0.0), got_x, atol=1e-4)
    nxt_y = p + first.tokens[1] + REPLY
    got_y = eng.generate([nxt_y], NEW, 0.0, sessions=["y"])
    assert got_y.cached_tokens == [len(p) + NEW - 1]
    _same(ref.generate([nxt_y], NEW, 0.0), got_y, atol=1e-4)
    eng.release(["x", "y"])
    assert eng.cache.free_blocks == eng.cache.num_blocks - 1
