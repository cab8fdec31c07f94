"""Small real model folders for tests (no hub: built from a config with the character tokenizer)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.models.tokenizer import build_char_tokenizer


def tiny_llama_folder(folder: Path) -> Path:
    """A tiny random dense LlamaForCausalLM folder with the character tokenizer (TRL loads it as is)."""
    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
