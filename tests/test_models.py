"""Tiny MoE factory and the local tokenizer: vLLM-compatible sizes, save/load round trip."""
from __future__ import annotations

import torch

from streamrl.config import ModelConfig
from streamrl.models import build_char_tokenizer, build_model, load_model_and_tokenizer
from streamrl.models.factory import save_model


def test_tokenizer_roundtrip_and_specials():
    tok = build_char_tokenizer()
    ids = tok.encode("12+3=15", add_special_tokens=False)
    assert tok.decode(ids) == "12+3=15"
    assert len(tok) % 32 == 0
    assert tok.eos_token_id != tok.pad_token_id


def test_tiny_moe_is_deterministic_and_vllm_sized():
    cfg = ModelConfig()
    m1, tok = build_model(cfg, seed=3)
    m2, _ = build_model(cfg, seed=3)
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
    c = m1.config
    assert c.head_dim >= 32 and c.hidden_size % 32 == 0 and c.moe_intermediate_size % 32 == 0
    assert c.vocab_size == len(tok)
    names = dict(m1.named_parameters())
    assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (cfg.num_experts, 2 * cfg.expert_size, cfg.hidden_size)
    assert names["model.layers.0.mlp.gate.weight"].shape == (cfg.num_experts, cfg.hidden_size)


def test_save_and_load_folder(tmp_path):
    cfg = ModelConfig()
    model, tok = build_model(cfg, seed=0)
    save_model(model, tok, tmp_path / "m")
    loaded, tok2 = load_model_and_tokenizer(ModelConfig(path=str(tmp_path / "m")))
    ids = torch.tensor([tok.encode("1234=", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-6)
    assert tok2.decode(ids[0].tolist()) == "1234="
