"""Models: the tiny random MoE factory, the local character tokenizer, HF folder loading."""
from streamrl.models.factory import build_model, load_model_and_tokenizer
from streamrl.models.tokenizer import build_char_tokenizer

__all__ = ["build_model", "build_char_tokenizer", "load_model_and_tokenizer"]
