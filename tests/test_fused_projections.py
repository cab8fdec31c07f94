"""Fused q/k/v and gate/up projections (streamrl/engines/fused_projections.py): every fused family
computes what its own forward does, parameters keep their identity, and writes reach the GEMM."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from streamrl.config import ModelConfig
from streamrl.engines.fused_projections import fuse_projections
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.models import build_model

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa")
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
FAMILIES = {  # (model class, config, fused modules: attentions + gated MLPs)
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, attention_bias=True), 4),
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=8), 4),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, **{k: MOE[k] for k in ("num_local_experts",
                                                                                   "num_experts_per_tok")}), 2),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE), 4),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**SHAPE, **{k: MOE[k] for k in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}), 4),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE), 4),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, **{k: MOE[k] for k in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size")}, mlp_only_layers=[1]), 3),
}


def pair(family: str):
    """(reference, fused) copies of one tiny random model of ``family``, fp32, eval."""
    cls, cfg, _ = FAMILIES[family]
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    with torch.no_grad():  # random biases too, so a misplaced one shows
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_fused_model_computes_what_the_family_computes(family):
    ref, fused = pair(family)
    assert fuse_projections(fused) == FAMILIES[family][2]
    ids = torch.randint(0, 128, (3, 11))
    with torch.no_grad():
        assert torch.allclose(fused(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
        # through the KV cache, one token at a time, as a decode step runs
        out_ref = ref.generate(ids, max_new_tokens=6, do_sample=False)
        out_fused = fused.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out_fused, out_ref)


def test_parameters_keep_identity_names_and_values_and_become_row_blocks_of_one_buffer():
    ref, fused = pair("qwen3")
    before = dict(fused.named_parameters())
    fuse_projections(fused)
    after = dict(fused.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(torch.equal(p, dict(ref.named_parameters())[n]) for n, p in after.items())
    attn = fused.model.layers[0].self_attn
    base = attn.qkv_weight.data_ptr()
    rows = [attn.q_proj, attn.k_proj, attn.v_proj]
    offsets = [lin.weight.data_ptr() - base for lin in rows]
    assert offsets == [0, 64 * 64 * 4, (64 + 32) * 64 * 4]  # q [64, 64], then k [32, 64], then v
    assert fuse_projections(fused) == 0  # already fused


def test_a_version_written_into_the_parameters_reaches_the_fused_gemm():
    """A weight load copies into the parameters in place: the fused forward computes with the new values."""
    ref, fused = pair("llama")
    fuse_projections(fused)
    torch.manual_seed(1)
    new = {n: torch.randn_like(p) * 0.05 for n, p in ref.named_parameters()}
    with torch.no_grad():
        torch._foreach_copy_([dict(fused.named_parameters())[n] for n in new], list(new.values()))
        for n, p in ref.named_parameters():
            p.copy_(new[n])
        ids = torch.randint(0, 128, (2, 9))
        assert torch.allclose(fused(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


class Wrapped(nn.Module):
    """A projection that is not a plain nn.Linear (as an adapter wrapper is)."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner
        self.out_features = inner.out_features

    def forward(self, x):
        return self.inner(x)


def test_a_group_with_a_wrapped_projection_keeps_its_own_forward():
    ref, fused = pair("llama")
    for layer in fused.model.layers:
        layer.self_attn.k_proj = Wrapped(layer.self_attn.k_proj)
    assert fuse_projections(fused) == 2  # the two MLPs only
    assert type(fused.model.layers[0].self_attn).__name__ == "LlamaAttention"
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        assert torch.allclose(fused(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_fused_engine_compiles_one_graph_for_every_layer_and_decodes_the_unfused_tokens():
    """The fused forward under ``torch.compile`` (as CUDA graphs capture it): one layer graph for all
    layers, no graph breaks, the tokens and routing of the unfused engine (the engine fuses on CUDA;
    here the model is fused by hand to run that path on CPU)."""
    from torch._dynamo.utils import counters

    model, tok = build_model(ModelConfig(), seed=1)
    ref_model = copy.deepcopy(model.eval())
    assert fuse_projections(model) == len(model.model.layers)  # every attention (the MLPs are MoE)
    prompts = [[5, 9, 13, 2], [7, 7, 30, 41, 12, 3], [22, 4]]
    config = FastHFConfig(batch_size=2, max_seq_len=32, record_routing=True)
    ref = FastHFEngine(ref_model, tok, config).generate(prompts, 8, 0.0)
    torch._dynamo.reset()
    counters.clear()
    eng = FastHFEngine(model, tok, config)
    eng._compile_decode()
    got = eng.generate(prompts, 8, 0.0)
    assert counters["stats"]["unique_graphs"] <= 3 and not counters["graph_break"]
    assert got.tokens == ref.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.routed_experts, ref.routed_experts))
    torch.testing.assert_close(torch.tensor(sum(got.logprobs, [])), torch.tensor(sum(ref.logprobs, [])),
                               atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_gpu_bf16_fused_is_no_further_from_fp32_than_unfused(family):
    """On CUDA in bf16 (the engine's case) the stacked GEMM's logits are as close to an fp32 run of the
    same bf16 weights as the separate GEMMs' are (bf16 outputs need not be bit-equal: greedy tokens
    of a random model may flip on near-ties, so the engine's own GPU tests compare with its model)."""
    ref, fused = pair(family)
    ref, fused = ref.cuda().to(torch.bfloat16), fused.cuda().to(torch.bfloat16)
    exact = copy.deepcopy(ref).float()
    fuse_projections(fused)
    ids = torch.randint(0, 128, (4, 16), device="cuda")
    with torch.no_grad():
        want = exact(ids).logits
        err_fused = (fused(ids).logits.float() - want).abs().max().item()
        err_ref = (ref(ids).logits.float() - want).abs().max().item()
        assert err_fused <= 1.5 * err_ref + 1e-3, (err_fused, err_ref)
