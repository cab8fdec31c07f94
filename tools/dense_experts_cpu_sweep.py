"""Where the dense decode experts stop paying on CPU: ms per hf_fast decode step, sparse vs dense.

    python tools/dense_experts_cpu_sweep.py [--threads 2] [--new-tokens 128]

Random 2-layer Qwen3-MoE models of growing expert size and count, one engine batch each, the
model's own experts (``grouped_mm``) against :data:`~streamrl.engines.dense_experts.DENSE` with
its CPU FLOP guard lifted; prints the FLOPs dense adds per layer per step (``rows (E - k) 6 H I``)
next to both step times (medians of 3). The guard, ``DENSE_CPU_MAX_EXTRA_FLOP``, sits below the
break-even this prints (on 2 cores dense is faster up to 19 MFLOP and slower from 25).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from streamrl.engines import dense_experts
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig

SHAPES = [(64, 64, 4, 2, 32), (128, 128, 4, 2, 32), (64, 64, 8, 2, 64), (128, 128, 8, 2, 32), (256, 256, 4, 2, 32),
          (256, 256, 8, 2, 64)]
"""(hidden H, expert size I, experts E, top-k, rows); the first is the tiny test model's shape."""


def step_ms(model, rows: int, impl, new_tokens: int) -> float:
    eng = FastHFEngine(model, None, FastHFConfig(batch_size=rows, max_seq_len=new_tokens + 16,
                                                 experts_implementation=impl,
                       eos_token_id=10**6))  # never drawn: every row decodes new_tokens
    prompts = [[1, 5, 6, 7, 8]] * rows
    eng.generate(prompts, 8, 1.0)  # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        eng.generate(prompts, new_tokens, 1.0)
        times.append((time.perf_counter() - t) / new_tokens * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dense_experts.DENSE_CPU_MAX_EXTRA_FLOP = float("inf")  # time dense everywhere
    for h, i, e, k, rows in SHAPES:
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=h, intermediate_size=i, moe_intermediate_size=i,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                             num_experts=e, num_experts_per_tok=k, max_position_embeddings=a.new_tokens + 16)
        model = Qwen3MoeForCausalLM(cfg).eval()
        sparse = step_ms(model, rows, None, a.new_tokens)
        dense = step_ms(model, rows, dense_experts.DENSE, a.new_tokens)
        added = dense_experts.dense_extra_flop(rows, e, k, h, i) / 1e6
        print(f"H {h:4d} I {i:4d} E {e} k {k} rows {rows:3d}: dense adds {added:6.1f} MFLOP a layer; "
              f"ms per step sparse {sparse:.3f}, dense {dense:.3f} ({sparse / dense:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
