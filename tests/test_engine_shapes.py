"""Every engine on the attention shapes of real models: grouped-query ratios 1, 3, 4, 8, head dims 64, 128.

Tiny random models in two layouts (dense Llama like SmolLM2, Qwen3-MoE with q/k norms). For
each engine, sampled tokens carry log-probs equal to teacher forcing of the tempered model,
and (hf_fast) greedy tokens are the teacher-forced argmax. The vllm(-cpu) engine runs the
same checks in the vllm tier; the real SmolLM2 folder (9 query heads, 3 KV heads) in the
slow tier.
"""
from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.config import ModelConfig
from streamrl.engines.hf import HFEngine
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.models.factory import build_model, save_model
from streamrl.models.tokenizer import build_char_tokenizer

TEMP = 0.8
TOL = 1e-4
RATIOS = (1, 3, 4, 8)
HEAD_DIMS = (64, 128)
ARCHS = ("llama", "qwen3_moe")


def shaped_model(arch: str, ratio: int, head_dim: int, seed: int = 0):
    """A 2-layer random model with ``ratio`` query heads per KV head (2 KV heads up to ratio 4)."""
    kv = 2 if ratio <= 4 else 1
    hidden = 32 * kv * ratio if ratio == 3 else 64  # transformers wants hidden % heads == 0
    if arch == "qwen3_moe":
        return build_model(ModelConfig(hidden_size=hidden, num_heads=kv * ratio, num_kv_heads=kv, head_dim=head_dim,
                                       max_positions=256), seed=seed)
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=kv * ratio, num_key_value_heads=kv, head_dim=head_dim,
                      max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.eval(), tok


def prompts_with_a_group(n: int = 3, group: int = 3, seed: int = 0) -> list[list[int]]:
    """``n`` random prompts of different lengths, the first repeated ``group`` times (a GRPO group)."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(4, 60, (int(k),), generator=g).tolist() for k in torch.randint(3, 12, (n,), generator=g)]
    return [ps[0]] * (group - 1) + ps


@torch.no_grad()
def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Raw logits ``[len(response), V]`` at the positions that predicted each response token."""
    ids = torch.tensor([prompt + response], device=model.device)
    return model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(response)].float().cpu()


def assert_behaviour_logprobs(model, prompts, gen, temperature: float) -> None:
    """Each recorded log-prob is that of the tempered teacher-forced distribution."""
    assert len(gen.tokens) == len(prompts)
    for p, toks, lps in zip(prompts, gen.tokens, gen.logprobs):
        assert len(toks) == len(lps) >= 1
        ref = torch.log_softmax(teacher_forced(model, p, toks) / temperature, -1)
        ref = ref.gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=TOL, rtol=0)


def assert_greedy(model, prompts, gen) -> None:
    for p, toks, lps in zip(prompts, gen.tokens, gen.logprobs):
        logits = teacher_forced(model, p, toks)
        assert toks == logits.argmax(-1).tolist()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("ratio", RATIOS)
def test_decode_attention_accepts_the_cuda_kernels_output_layout(monkeypatch, ratio):
    """CUDA's SDPA kernels return ``[b, h, q, d]`` as a transposed view of a ``[b, q, h, d]`` buffer;
    with the query heads folded into the query axis that is what crashed SmolLM2 (``view`` on it)."""
    import torch.nn.functional as F

    from streamrl.engines.static_kv import static_attention

    sdpa = F.scaled_dot_product_attention

    def cuda_like(*args, **kwargs):
        out = sdpa(*args, **kwargs)  # [b, h, q, d] -> same values, strides of [b, q, h, d]
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    b, hkv, d, span = 3, 2, 64, 7
    hq = hkv * ratio
    g = torch.Generator().manual_seed(ratio)
    query = torch.randn(b, 1, hq, d, generator=g).transpose(1, 2)  # HF's q_proj(...).view().transpose()
    key, value = torch.randn(b, hkv, span, d, generator=g), torch.randn(b, hkv, span, d, generator=g)
    mask = torch.zeros(b, 1, 1, span)
    mask[0, ..., 5:] = float("-inf")
    want = sdpa(query, key.repeat_interleave(ratio, 1), value.repeat_interleave(ratio, 1), attn_mask=mask)
    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_like)
    got, _ = static_attention(None, query, key, value, mask, scaling=d ** -0.5)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=0)  # [b, q, hq, d]


SHAPES = [(a, r, d) for a in ARCHS for r in RATIOS for d in HEAD_DIMS]


# flex (FlexAttention over each row's blocks, the CUDA default for long caches) on every ratio, one arch per head dim
FLEX_SHAPES = [("llama", r, 64) for r in RATIOS] + [("qwen3_moe", r, 128) for r in RATIOS]


@pytest.mark.parametrize("arch,ratio,head_dim,decode_attention",
                         [(*s, "sdpa") for s in SHAPES] + [(*s, "flex") for s in FLEX_SHAPES])
def test_hf_fast_on_grouped_query_shapes(arch, ratio, head_dim, decode_attention):
    model, tok = shaped_model(arch, ratio, head_dim)
    prompts = prompts_with_a_group()
    # 2 slots for 5 prompts: refills happen, and the group's prompt is prefilled for its siblings
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=64, eos_token_id=-1,
                                                decode_attention=decode_attention))
    torch.manual_seed(0)
    assert_behaviour_logprobs(model, prompts, eng.generate(prompts, 8, TEMP), TEMP)
    assert_greedy(model, prompts, eng.generate(prompts, 8, 0.0))


@pytest.mark.parametrize("arch,ratio,head_dim", [s for s in SHAPES if s[2] == 64] + [("llama", 8, 128)])
def test_hf_engine_on_grouped_query_shapes(arch, ratio, head_dim):
    model, tok = shaped_model(arch, ratio, head_dim)
    prompts = prompts_with_a_group()
    torch.manual_seed(0)
    gen = HFEngine(model, tok).generate(prompts, 8, TEMP)
    assert_behaviour_logprobs(model, prompts, gen, TEMP)


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,ratio,head_dim", [("llama", 3, 64), ("qwen3_moe", 4, 128), ("llama", 8, 128)])
def test_vllm_on_grouped_query_shapes(tmp_path, arch, ratio, head_dim):
    from streamrl.engines.vllm_engine import VLLMEngine

    model, tok = shaped_model(arch, ratio, head_dim)
    save_model(model, tok, tmp_path)
    prompts = prompts_with_a_group()
    eng = VLLMEngine(str(tmp_path), dtype="float32", kv_cache_bytes=32 << 20, max_model_len=128, seed=0)
    try:
        assert_behaviour_logprobs(model, prompts, eng.generate(prompts, 8, TEMP), TEMP)
    finally:
        eng.close()


SMOL = os.path.join(os.path.dirname(__file__), "..", "models", "smol")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(SMOL), reason="models/smol not prepared (streamrl-prepare-model)")
def test_smol_folder_on_both_transformers_engines():
    """SmolLM2-135M (9 query heads, 3 KV heads, head dim 64): the shape that crashed hf_fast."""
    from streamrl.models.factory import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(ModelConfig(path=SMOL))
    model.eval()
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 3
    texts = ["What is 12 + 7?", "Name a colour.", "Count to three:"]
    prompts = [tok.encode(t) for t in texts]
    prompts = [prompts[0]] * 2 + prompts
    fast = FastHFEngine(model, tok, FastHFConfig(batch_size=3, max_seq_len=64))
    torch.manual_seed(0)
    assert_behaviour_logprobs(model, prompts, fast.generate(prompts, 12, TEMP), TEMP)
    assert_greedy(model, prompts, fast.generate(prompts, 12, 0.0))
    fast.close()
    torch.manual_seed(0)
    assert_behaviour_logprobs(model, prompts, HFEngine(model, tok).generate(prompts, 12, TEMP), TEMP)
