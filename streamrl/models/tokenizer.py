"""A local character-level tokenizer for synthetic tasks: nothing comes from a hub.

It is a real ``PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel model over single
characters), so it saves to an HF folder that transformers and vLLM both load.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Digits first after the specials keeps ids stable and easy to read in tests.
CHARACTERS = list("0123456789") + list("+-*=?:,. ") + list("abcdefghijklmnopqrstuvwxyz")


def build_char_tokenizer(vocab_multiple: int = 32) -> PreTrainedTokenizerFast:
    """Build the character tokenizer; ``len(tok)`` is padded up to ``vocab_multiple``.

    Examples:
        >>> tok = build_char_tokenizer()
        >>> tok.decode(tok.encode("12+3"))
        '12+3'
    """
    symbols = SPECIAL_TOKENS + CHARACTERS
    while len(symbols) % vocab_multiple:
        symbols.append(f"<extra_{len(symbols)}>")
    vocab = {s: i for i, s in enumerate(symbols)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tok.padding_side = "left"
    return tok
