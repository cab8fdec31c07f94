"""Learner names -> vLLM checkpoint names (no vLLM needed): what save_pretrained writes."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.config import ModelConfig
from streamrl.engines.vllm_engine import CheckpointNameAdapter
from streamrl.models.factory import build_model, save_model
from streamrl.models.upcycle import upcycle_to_mixtral


def _saved(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _tiny_llama():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_adapter_produces_the_checkpoint_layout(tmp_path, arch):
    if arch == "qwen3_moe":
        model, tok = build_model(ModelConfig(), seed=0)
    else:
        model, tok = upcycle_to_mixtral(_tiny_llama(), 4, 2, seed=0), build_model(ModelConfig())[1]
    save_model(model, tok, tmp_path)
    want = _saved(tmp_path)
    got = CheckpointNameAdapter(str(tmp_path))(model.named_parameters())
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


def test_adapter_accepts_already_split_experts(tmp_path):
    pytest.importorskip("streamrl.weights.adapter")
    from streamrl.weights.adapter import adapt_tensor

    model, tok = build_model(ModelConfig(), seed=0)
    save_model(model, tok, tmp_path)
    split = [pair for n, p in model.named_parameters() for pair in adapt_tensor(n, p.detach(), "vllm")]
    got = CheckpointNameAdapter(str(tmp_path))(split)
    want = _saved(tmp_path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
