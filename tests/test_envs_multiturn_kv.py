"""Multi-turn episodes on the fast engine: the KV of earlier turns is reused (same episodes as a
full re-prefill, fewer prefilled tokens, log-probs still teacher forcing) and lanes let one part of
the batch generate while another part's tools run."""
from __future__ import annotations

import time

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.envs.base import FunctionEnv, StepResult
from streamrl.envs.episode import EpisodeLimits, episode_metrics, run_episodes
from streamrl.envs.render import PlainTextRenderer
from streamrl.models.factory import build_model

TOOL_REPLY = "=42 "  # characters the char tokenizer knows
PROBLEMS = ["12+34=", "5*6=", "999+1=", "7*8=", "3-1="]


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_model(ModelConfig(max_positions=256), seed=5)
    return model.eval(), tok


def _env(turns: int, tool_s: float = 0.0, log: list | None = None):
    """Every turn but the last is answered by a tool reply (after ``tool_s`` seconds); the last
    one ends the episode with reward 1."""
    def step(problem, seen):
        t0 = time.perf_counter()
        if len(seen) < turns:
            time.sleep(tool_s)
            if log is not None:
                log.append(("tool", t0, time.perf_counter()))
            return StepResult([{"role": "tool", "content": TOOL_REPLY}], 0.0, False, {"tool_calls": 1.0})
        return StepResult([], 1.0, True)
    return FunctionEnv(lambda p: [{"role": "user", "content": p}], step)


def _play(eng, tok, turns, temperature=0.0, seed=0, **kw):
    torch.manual_seed(seed)
    limits = EpisodeLimits(max_turns=max(turns), max_turn_tokens=5, max_response_tokens=48)
    return run_episodes(eng, [_env(t) for t in turns], PROBLEMS[: len(turns)], PlainTextRenderer(tok), tok.decode,
                        tok.eos_token_id, limits, temperature=temperature, **kw)


def _same_episodes(a, b):
    for x, y in zip(a, b):
        assert (x.response, x.mask, x.versions, x.turns, x.stop, x.reward) == \
            (y.response, y.mask, y.versions, y.turns, y.stop, y.reward)
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv", ["static", "paged"])
def test_kv_reuse_gives_the_episodes_of_full_reprefill_with_fewer_prefilled_tokens(tiny, kv):
    """Greedy episodes of 2-4 turns (some end before others): with kept sessions the episodes are
    those of full re-prefill, only each turn's new tokens are prefilled, and every session is
    released when its episode ends."""
    model, tok = tiny
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=8, max_seq_len=64, kv_cache=kv, block_size=8))
    turns = [2, 4, 3, 4, 2]
    reused = _play(eng, tok, turns)
    full = _play(eng, tok, turns, reuse_kv=False)
    _same_episodes(reused, full)
    assert len(eng.sessions) == 0
    if kv == "paged":
        assert eng.cache.free_blocks == eng.cache.num_blocks - 1
    m_reused, m_full = episode_metrics(reused), episode_metrics(full)
    assert m_full["env/prefill_tokens_saved"] == 0
    # turn k > 1 reuses everything but the previous turn's last token and the tool reply
    assert m_reused["env/prefill_tokens_saved"] == sum(
        ep.prompt_tokens - len(ep.prompt) - (ep.turns - 1) * (1 + len(TOOL_REPLY)) for ep in reused)
    assert m_reused["env/prefill_tokens"] + m_reused["env/prefill_tokens_saved"] == m_full["env/prefill_tokens"]
    assert m_reused["env/prefill_tokens"] < m_full["env/prefill_tokens"] / 2


def test_reused_kv_keeps_seeded_samples_and_teacher_forced_logprobs(tiny):
    """Seeded sampling, two turns each: the same episodes with and without reuse, and every model
    token's behaviour log-prob equals teacher forcing over the whole conversation."""
    model, tok = tiny
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=8, max_seq_len=64))
    reused = _play(eng, tok, [2] * 4, temperature=1.0, seed=3)
    _same_episodes(reused, _play(eng, tok, [2] * 4, temperature=1.0, seed=3, reuse_kv=False))
    assert episode_metrics(reused)["env/prefill_tokens_saved"] > 0
    scored = eng.score([ep.prompt + ep.response for ep in reused], [len(ep.prompt) for ep in reused])
    for ep, ref in zip(reused, scored):
        assert ep.turns == 2 and not all(ep.mask)
        model_pos = [j for j, m in enumerate(ep.mask) if m]
        torch.testing.assert_close(torch.tensor([ep.logprobs[j] for j in model_pos]),
                                   torch.tensor([ref[j] for j in model_pos]), atol=1e-4, rtol=0)


class _Timed:
    """The engine, with the wall-clock interval of every generate call logged."""

    def __init__(self, engine, log):
        self.engine, self.log = engine, log
        self.release = engine.release

    def generate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.log.append(("gen", t0, time.perf_counter()))


def test_lanes_generate_while_other_episodes_tools_run(tiny):
    """Two lanes, a 0.5 s tool: the second lane's first turn is generated while the first lane's
    tools run, and the episodes (complete, in order) equal those of one lane."""
    model, tok = tiny
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=8, max_seq_len=64))
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=5, max_response_tokens=48)
    runs = {}
    for lanes in (1, 2):
        log = []
        envs = [_env(3, tool_s=0.5, log=log) for _ in range(4)]
        runs[lanes] = (run_episodes(_Timed(eng, log), envs, PROBLEMS[:4], PlainTextRenderer(tok), tok.decode,
                                    tok.eos_token_id, limits, temperature=0.0, lanes=lanes), log)
    _same_episodes(runs[1][0], runs[2][0])
    assert all(ep.turns == 3 and ep.stop == "done" for ep in runs[2][0])

    def overlapping(log):
        gens = [(a, b) for k, a, b in log if k == "gen"]
        tools = [(a, b) for k, a, b in log if k == "tool"]
        return sum(any(ta < gb and ga < tb for ta, tb in tools) for ga, gb in gens)  # intervals intersect

    assert overlapping(runs[1][1]) == 0  # one lane: generation waits for every tool
    assert overlapping(runs[2][1]) >= 2  # each turn but the last: a lane generates while the other's tools run
    assert len([k for k, *_ in runs[2][1] if k == "gen"]) == 6  # 2 lanes x 3 turns
