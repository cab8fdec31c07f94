"""Dense decode experts (every expert on every row, weighted by the routing) = HF's sparse experts, over the
engine's expert-minor ``down_proj``."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from streamrl.config import ModelConfig
from streamrl.engines import dense_experts
from streamrl.engines.dense_experts import (DENSE, DENSE_CPU_MAX_EXTRA_FLOP, DENSE_MAX_TOKENS, dense_experts_forward,
                                             dense_extra_flop, lay_out_for_dense_decode)
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.models import build_model


def _block(dtype: torch.dtype, experts: int = 16, top_k: int = 4) -> Qwen3MoeSparseMoeBlock:
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert lay_out_for_dense_decode(block) == 1
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_equals_the_sparse_experts(dtype):
    block = _block(dtype)
    x = torch.randn(37, 64, dtype=dtype)
    _, weights, ids = block.gate(x)
    got = dense_experts_forward(block.experts, x, ids, weights)
    assert got.shape == x.shape and got.dtype == dtype
    sparse = grouped_mm_experts_forward(block.experts, x, ids, weights)
    block.experts.config._experts_implementation = "eager"  # HF's per-expert loop: the reference semantics
    eager = block.experts(x, ids, weights)
    if dtype == torch.float32:
        torch.testing.assert_close(got, eager, atol=1e-6, rtol=0)
        return
    # bf16: each path rounds twice (dense: the weighted activation, the output; sparse: each expert's output,
    # the output); against the same bf16 weights computed in fp32, dense is no further off than sparse
    exact = block.float().experts(x.float(), ids, weights.float())
    dense_err, sparse_err = (got.float() - exact).abs().max(), (sparse.float() - exact).abs().max()
    assert dense_err <= 1.5 * sparse_err, (dense_err, sparse_err)
    torch.testing.assert_close(got, eager, atol=1e-2, rtol=0)


def test_the_layout_keeps_values_and_parameters_and_a_module_not_laid_out_goes_sparse(monkeypatch):
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=16, num_experts_per_tok=4)
    block = Qwen3MoeSparseMoeBlock(cfg)
    torch.nn.init.normal_(block.experts.down_proj, std=0.1)
    param, before = block.experts.down_proj, block.experts.down_proj.detach().clone()
    x = torch.randn(9, 64)
    _, weights, ids = block.gate(x)
    calls = []
    real_sparse = dense_experts._sparse
    monkeypatch.setattr(dense_experts, "_sparse", lambda *a: calls.append(a[1].shape[0]) or real_sparse(*a))
    sparse = dense_experts_forward(block.experts, x, ids, weights)  # contiguous [E, H, I]: not for the dense GEMM
    assert calls == [9]
    assert lay_out_for_dense_decode(block) == 1 and lay_out_for_dense_decode(block) == 0  # once
    assert block.experts.down_proj is param and torch.equal(param, before)
    assert param.permute(1, 0, 2).is_contiguous()  # [H, E, I] in memory
    torch.testing.assert_close(dense_experts_forward(block.experts, x, ids, weights), sparse, atol=1e-6, rtol=0)
    assert calls == [9]
    torch.testing.assert_close(grouped_mm_experts_forward(block.experts, x, ids, weights), sparse, atol=1e-6, rtol=0)


def test_more_tokens_than_the_dense_limit_go_sparse(monkeypatch):
    """A prefill-sized call takes HF's sparse path (dense would cost E / k times the FLOPs)."""
    block = _block(torch.float32)
    monkeypatch.setattr("streamrl.engines.dense_experts.DENSE_CPU_MAX_EXTRA_FLOP", float("inf"))  # the CUDA rule
    calls = []
    monkeypatch.setattr("streamrl.engines.dense_experts._sparse", lambda *a: calls.append(a[1].shape[0]) or a[1])
    x = torch.randn(DENSE_MAX_TOKENS + 1, 64)
    _, weights, ids = block.gate(x)
    dense_experts_forward(block.experts, x, ids, weights)
    assert calls == [DENSE_MAX_TOKENS + 1]
    dense_experts_forward(block.experts, x[:DENSE_MAX_TOKENS], ids[:DENSE_MAX_TOKENS], weights[:DENSE_MAX_TOKENS])
    assert calls == [DENSE_MAX_TOKENS + 1]


def test_on_cpu_calls_that_would_add_many_flops_go_sparse(monkeypatch):
    """On CPU the dense path runs only while its added FLOPs, ``T (E - k) 6 H I``, stay under
    ``DENSE_CPU_MAX_EXTRA_FLOP``: the tiny model's decode steps run dense, a large expert layer sparse."""
    block = _block(torch.float32)  # E 16, k 4, H 64, I 48: 221k FLOPs added per token
    calls = []
    monkeypatch.setattr("streamrl.engines.dense_experts._sparse", lambda *a: calls.append(a[1].shape[0]) or a[1])
    per_token = dense_extra_flop(1, 16, 4, 64, 48)
    fits = int(DENSE_CPU_MAX_EXTRA_FLOP // per_token)
    x = torch.randn(fits + 1, 64)
    _, weights, ids = block.gate(x)
    dense_experts_forward(block.experts, x[:fits], ids[:fits], weights[:fits])
    assert calls == []
    dense_experts_forward(block.experts, x, ids, weights)
    assert calls == [fits + 1]


def test_auto_picks_the_dense_experts_on_cpu_and_they_decode_the_tiny_model_densely(monkeypatch):
    model, tok = build_model(ModelConfig(), seed=1)
    eng = FastHFEngine(model.eval(), tok, FastHFConfig(batch_size=32, max_seq_len=64))
    assert eng.experts_impl == DENSE
    cfg = model.config  # the tiny model: 32 rows add 1.6 MFLOP a layer
    assert dense_extra_flop(32, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                            cfg.moe_intermediate_size) <= DENSE_CPU_MAX_EXTRA_FLOP
    sparse_calls = []
    real_sparse = dense_experts._sparse
    monkeypatch.setattr(dense_experts, "_sparse", lambda *a: sparse_calls.append(a[1].shape[0]) or real_sparse(*a))
    eng.generate([[5, 6, 7]] * 32, 6, 1.0)
    assert sparse_calls == []  # no call of the generation, prefill or decode step, left the dense path


def test_engine_with_dense_experts_decodes_what_the_sparse_engine_decodes():
    """The engine on the tiny MoE with the dense decode experts (its CUDA default) gives the same greedy
    tokens, log-probs and recorded routing as with the model's own experts, and the step still traces
    as one graph (what CUDA graphs capture)."""
    model, tok = build_model(ModelConfig(), seed=1)
    model.eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (3, 7, 5, 9, 4)]
    ref = FastHFEngine(model, tok, FastHFConfig(batch_size=3, max_seq_len=32, record_routing=True,
                       experts_implementation=None)).generate(prompts, 10, 0.0)
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=3, max_seq_len=32, record_routing=True,
                                                experts_implementation=DENSE))
    got = eng.generate(prompts, 10, 0.0)
    assert got.tokens == ref.tokens
    for a, b in zip(got.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(got.routed_experts, ref.routed_experts))
    with torch.no_grad(), eng._impl():
        eng.max_new.fill_(4)
        eng.prefill([0, 1, 2], prompts[:3], True)
        explained = torch._dynamo.explain(eng._decode)(32, True)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_dense_and_grouped_mm_over_the_expert_minor_layout():
    """On CUDA in bf16 (the dense path's home; ``moe-1b``'s expert shape, a decode batch of 256): the dense
    path is no further from the fp32 result than HF's grouped_mm, and grouped_mm (the prefills) reads the
    expert-minor ``down_proj`` through its strides as it read the contiguous one."""
    cfg = Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=192, num_experts=64, num_experts_per_tok=8,
                         norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    _, weights, ids = block.gate(x)
    contiguous = grouped_mm_experts_forward(block.experts, x, ids, weights)
    assert lay_out_for_dense_decode(block) == 1
    torch.testing.assert_close(grouped_mm_experts_forward(block.experts, x, ids, weights), contiguous)
    got = dense_experts_forward(block.experts, x, ids, weights)
    exact = grouped_mm_experts_forward(block.float().experts, x.float(), ids, weights.float())
    dense_err, sparse_err = (got.float() - exact).abs().max(), (contiguous.float() - exact).abs().max()
    assert dense_err <= 1.5 * sparse_err, (dense_err, sparse_err)
