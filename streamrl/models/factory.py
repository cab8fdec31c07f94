"""Model factory: a tiny random Qwen3-MoE from a :class:`ModelConfig`, or an HF folder.

The tiny model uses the transformers Qwen3-MoE layout (fused experts ``gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I], router ``gate.weight`` [E, H]) with sizes vLLM's
CPU backend can also run (head_dim >= 32, widths divisible by 32).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from streamrl.config import ModelConfig
from streamrl.models.resolve import resolve_model_path
from streamrl.models.sharded_load import build_empty_model
from streamrl.models.tokenizer import build_char_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tiny_moe_config(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> Qwen3MoeConfig:
    """The HF config of the tiny MoE described by ``cfg``."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.expert_size,
        moe_intermediate_size=cfg.expert_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=cfg.max_positions,
        output_router_logits=False,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype=cfg.dtype,
    )


def build_model(cfg: ModelConfig, seed: int = 0):
    """Build ``(model, tokenizer)``: the tiny random MoE, initialised deterministically from ``seed``."""
    tok = build_char_tokenizer()
    hf_cfg = tiny_moe_config(cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(hf_cfg)
    return model.to(_DTYPES[cfg.dtype]), tok


def load_model_and_tokenizer(cfg: ModelConfig, seed: int = 0, defer_weights: bool = False
                             ) -> tuple[PreTrainedModel, object]:
    """Load from ``cfg.path`` (an HF folder or a cached hub id) when set, else build the tiny model.

    ``defer_weights`` (the learner): with ``model.load = sharded`` and a folder, the model comes
    back with its parameters on the meta device and :func:`~streamrl.parallel.expert_parallel.parallelize`
    loads each rank's shards, so no rank holds the whole model. Random-init models are always
    built whole: their seeded init must be the same tensors on every rank before sharding, and
    they are the tiny models of tests and demos.
    """
    if not cfg.path:
        return build_model(cfg, seed)
    folder = resolve_model_path(cfg.path)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if defer_weights and cfg.load == "sharded":
        return build_empty_model(folder, _DTYPES[cfg.dtype]), tok
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=_DTYPES[cfg.dtype])
    return model, tok


def save_model(model: PreTrainedModel, tok, folder: str | Path) -> None:
    """Save an HF folder (safetensors + config + tokenizer) that transformers and vLLM load."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
