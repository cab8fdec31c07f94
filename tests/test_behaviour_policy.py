"""The sampling distribution is the behaviour policy: a model folder's generation_config.json
(repetition penalty, min-p) must not reshape what the engines sample from.

The folder below asks for a strong repetition penalty and min-p 0.95. Two checks per engine:
recorded log-probs equal the plain tempered teacher-forced ones, and 1,000 first-token draws
of one prompt follow that distribution (total variation < 0.2; with the folder's processors
applied the draws pile onto one or two tokens, TV ~ 0.9, although the old hf engine still
recorded the untouched log-probs).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.models.factory import build_model, load_model_and_tokenizer, save_model

TEMP = 1.0
TOL = 1e-4
FOLDER_SAMPLING = {"repetition_penalty": 3.0, "min_p": 0.95, "do_sample": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model, tok = build_model(ModelConfig(max_positions=128), seed=3)
    path = tmp_path_factory.mktemp("gencfg-model")
    save_model(model, tok, path)
    cfg_file = path / "generation_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    cfg_file.write_text(json.dumps({**cfg, **FOLDER_SAMPLING}))
    return str(path)


def _prompts(tok) -> list[list[int]]:
    texts = ["1234=", "5555+5555=", "7=", "31415926 ", "9876543210"]
    return [tok.encode(t, add_special_tokens=False) for t in texts for _ in range(2)]


def check_tempered(model, prompts, gen) -> None:
    """Each recorded log-prob equals the tempered teacher-forced one."""
    for p, toks, lps in zip(prompts, gen.tokens, gen.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + toks])).logits[0, len(p) - 1: len(p) - 1 + len(toks)]
        ref = torch.log_softmax(logits.float() / TEMP, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=TOL, rtol=0)


def check_draws_follow_recorded(eng, prompt: list[int], n: int = 1000) -> float:
    """Total variation between ``n`` first-token draws and the recorded distribution (mu = exp(lp))."""
    gen = eng.generate([prompt] * n, 1, TEMP)
    draws = torch.tensor([t[0] for t in gen.tokens])
    recorded = {}
    for t, lp in zip(draws.tolist(), gen.logprobs):
        recorded.setdefault(t, math.exp(lp[0]))
    freq = torch.bincount(draws).float() / n
    seen = sum(abs(freq[t].item() - p) for t, p in recorded.items())
    tv = 0.5 * (seen + (1.0 - sum(recorded.values())))  # mass recorded for tokens never drawn counts fully
    assert tv < 0.2, f"draws do not follow the recorded log-probs: TV = {tv:.3f}"
    return tv


@pytest.mark.parametrize("engine", ["hf", "hf_fast"])
def test_folder_generation_config_is_not_applied(folder, engine):
    from streamrl.engines.hf import HFEngine
    from streamrl.engines.hf_fast import FastHFEngine
    from streamrl.engines.hf_fast_config import FastHFConfig

    model, tok = load_model_and_tokenizer(ModelConfig(path=folder))
    assert model.generation_config.repetition_penalty == 3.0  # the folder really asks for it
    reference = load_model_and_tokenizer(ModelConfig(path=folder))[0].eval()
    prompts = _prompts(tok)
    eng = HFEngine(model, tok) if engine == "hf" else FastHFEngine(model, tok, FastHFConfig(batch_size=200,
                                                                                            max_seq_len=64))
    torch.manual_seed(0)
    check_tempered(reference, prompts, eng.generate(prompts, 16, TEMP))
    check_draws_follow_recorded(eng, prompts[0])


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_ignores_folder_generation_config(folder):
    from streamrl.engines.vllm_engine import VLLMEngine

    model, tok = load_model_and_tokenizer(ModelConfig(path=folder))
    prompts = _prompts(tok)
    eng = VLLMEngine(folder, dtype="float32", kv_cache_bytes=32 << 20, max_model_len=128, seed=0)
    try:
        check_tempered(model.eval(), prompts, eng.generate(prompts, 16, TEMP))
        check_draws_follow_recorded(eng, prompts[0])
    finally:
        eng.close()
