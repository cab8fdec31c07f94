"""Sparse upcycling preserves the function (tiny Llama; the SmolLM2 case is in test_prepare_model)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.models.upcycle import mixtral_config_from_dense, upcycle_to_mixtral


def _dense():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, max_position_embeddings=64,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("experts,k", [(4, 2), (8, 1), (2, 2)])
def test_upcycled_logits_equal_dense(experts, k):
    dense = _dense()
    moe = upcycle_to_mixtral(dense, experts, k, router_std=0.5, seed=1)
    x = torch.randint(0, 64, (3, 17))
    with torch.no_grad():
        d = (dense(x).logits - moe(x).logits).abs().max().item()
    assert d < 1e-4
    assert moe.model.layers[0].mlp.experts.gate_up_proj.shape == (experts, 2 * 96, 64)
    # the router is random, so tokens already spread over experts
    with torch.no_grad():
        logits = moe(x, output_router_logits=True).router_logits[0]
    if k < experts:
        assert logits.topk(k, -1).indices.unique().numel() > 1


def test_upcycle_rejects_bad_sizes():
    with pytest.raises(ValueError, match="experts_per_token"):
        mixtral_config_from_dense(_dense().config, 4, 5)
    with pytest.raises(ValueError, match="num_experts"):
        mixtral_config_from_dense(_dense().config, 0, 1)
