"""Static-cache decode through FlexAttention (each row's own 128-position blocks) = the sdpa decode."""
from __future__ import annotations

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.engines.static_kv import FLEX_BLOCK
from streamrl.models import build_model


@pytest.fixture(scope="module")
def tiny_long():
    model, tok = build_model(ModelConfig(max_positions=400), seed=1)
    return model.eval(), tok


def _decode(model, tok, attention: str, compiled: bool = False):
    g = torch.Generator().manual_seed(4)
    # prompts of 100..250 tokens and 40 new ones: rows sit in different blocks and cross block borders;
    # 5 prompts through 3 slots: a refilled slot attends only its new sequence's blocks
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (100, 250, 120, 126, 170)]
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=3, max_seq_len=300, sync_every=4,
                                                decode_attention=attention))
    if compiled:
        # a fresh dynamo cache: after other engines' compiled steps in this process, automatic dynamic
        # shapes would make this compile symbolic, which torch's CPU FlexAttention codegen fails on
        # (CUDA workers compile one engine's step once, with static shapes)
        torch._dynamo.reset()
        eng._compile_decode()
    return eng, eng.generate(prompts, 40, 0.0)


def test_flex_decode_equals_sdpa_across_blocks_and_refills(tiny_long):
    model, tok = tiny_long
    _, ref = _decode(model, tok, "sdpa")
    eng, got = _decode(model, tok, "flex")
    assert eng.cache.max_span % FLEX_BLOCK == 0 and eng.cache.max_span >= 300
    assert got.tokens == ref.tokens
    for a, b in zip(got.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_flex_decode_equals_sdpa(tiny_long):
    """The compiled step (what CUDA graphs capture) runs FlexAttention's kernel, which skips blocks; and it
    leaves the process's compiled FlexAttention intact: a paged engine reading its pool through flex
    afterwards decodes what the gathering one does (once, the traced step replaced it with the plain
    function, whose fallback ignores block lists)."""
    model, tok = tiny_long
    _, ref = _decode(model, tok, "sdpa")
    eng, got = _decode(model, tok, "flex", compiled=True)
    assert eng.compiled and got.tokens == ref.tokens
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (3, 9, 6, 11)]
    paged = {a: FastHFEngine(model, tok, FastHFConfig(batch_size=3, max_seq_len=32, kv_cache="paged", block_size=4,
                             paged_attention=a)).generate(prompts, 12, 0.0) for a in ("gather", "flex")}
    assert paged["flex"].tokens == paged["gather"].tokens


def test_flex_decode_needs_the_static_cache():
    model, tok = build_model(ModelConfig(), seed=1)
    with pytest.raises(ValueError, match="decode_attention"):
        FastHFEngine(model, tok, FastHFConfig(kv_cache="paged", decode_attention="flex"))
