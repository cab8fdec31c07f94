"""Fast transformers rollout vs plain ``model.generate()`` on the same model, prompts and lengths.

Both paths sample (temperature 1, no truncation) ``batch`` responses of exactly
``new_tokens`` tokens (EOS is disabled in both by an out-of-vocabulary id, so the lengths
match) after random ``prompt_len``-token prompts, each after one warm-up run (the fast
path's warm-up compiles and captures its CUDA graphs: ~100 s for the 1 B MoE on an H200,
reported as ``fast_warmup_s``). ``ratio_vs_plain_generate`` is the tokens/s ratio.

The bandwidth floor of one decode step is the bytes it must read: every weight but the
input embedding (with ``batch * top_k`` routed tokens per layer almost every expert is hit)
plus the K/V of the attended positions, at the device's memory bandwidth.

Examples:
    python -m streamrl.bench.hf_fast --json                                    # CPU, tiny MoE
    python -m streamrl.bench.hf_fast --preset moe-1b --device cuda --json      # H200
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig

PRESETS = {
    # The project's tiny random MoE (ModelConfig defaults): a CPU smoke figure.
    "tiny": dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    # ~1.04 B total / ~211 M active (without the input embedding) Qwen3-MoE.
    "moe-1b": dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                   moe_intermediate_size=192),
    # The SmolLM2-135M shape (dense Llama, tied embeddings): the reasoning recipe's model with random weights.
    "smol-135m": dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, intermediate_size=1536, tie_word_embeddings=True),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_bench_model(preset: str, device: str, dtype: str, seed: int = 0, path: str | None = None):
    """A random model of ``preset`` (Qwen3-MoE, or Llama for a dense one) built directly on ``device`` in
    ``dtype``, or the HF folder ``path``."""
    if path:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype = {dtype!r}: must be one of {sorted(_DTYPES)}")
        return AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype]).to(device).eval()
    if preset not in PRESETS:
        raise ValueError(f"preset = {preset!r}: must be one of {sorted(PRESETS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype = {dtype!r}: must be one of {sorted(_DTYPES)}")
    p = PRESETS[preset]
    ids = dict(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if "num_experts" in p:
        cls, cfg = Qwen3MoeForCausalLM, Qwen3MoeConfig(**p, intermediate_size=p["moe_intermediate_size"],
                                                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                                       tie_word_embeddings=False, **ids)
    else:
        cls, cfg = LlamaForCausalLM, LlamaConfig(**p, **ids)
    old = torch.get_default_dtype()
    torch.set_default_dtype(_DTYPES[dtype])
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def param_counts(model) -> dict:
    """Total parameters and active ones per token (top-k of E experts, input embedding excluded)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.model.embed_tokens.weight.numel()
    k, e = getattr(cfg, "num_experts_per_tok", 1), getattr(cfg, "num_experts", 1)  # dense: 1 of 1
    active = total - embed - experts + experts * k // e
    return {"params_total": total, "params_active": active, "params_embedding": embed}


# Spec HBM bandwidth (TB/s) by a substring of torch.cuda.get_device_name(), most specific first.
SPEC_BANDWIDTH_TB_S = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35),
                       ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555))


def spec_bandwidth_tb_s(device_name: str) -> float | None:
    """The card's spec memory bandwidth in TB/s, None for a card not in :data:`SPEC_BANDWIDTH_TB_S`."""
    return next((bw for key, bw in SPEC_BANDWIDTH_TB_S if key in device_name), None)


def bandwidth_floor(model, batch: int, prompt_len: int, new_tokens: int, bytes_per_s: float) -> dict:
    """Bytes one decode step must read (weights + mean attended K/V) and the implied tok/s bound."""
    cfg = model.config
    el = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters())  # tied head and embedding counted once
    if not getattr(cfg, "tie_word_embeddings", False):  # the input embedding reads B rows only
        weights -= model.model.embed_tokens.weight.numel()
    e, k = getattr(cfg, "num_experts", 1), getattr(cfg, "num_experts_per_tok", 1)  # dense: 1 of 1
    hit = 1.0 - (1.0 - k / e) ** batch  # expected fraction of experts a step touches
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    w_bytes = (weights - experts + experts * hit) * el
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mean_len = prompt_len + new_tokens / 2
    kv_bytes = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * head_dim * mean_len * el
    step_s = (w_bytes + kv_bytes) / bytes_per_s
    return {"step_bytes_weights": int(w_bytes), "step_bytes_kv_mean": int(kv_bytes),
            "floor_step_ms": step_s * 1e3, "floor_tok_s": batch / step_s}


def kv_memory(engine) -> dict:
    """KV memory of ``engine`` in GiB: allocated, in use at the peak (paged), the static cache of its shape."""
    cache, gib = engine.cache, float(1 << 30)
    paged = hasattr(cache, "block_size")
    positions = cache.num_blocks * cache.block_size if paged else engine.batch * engine.max_len
    per_pos = cache.bytes() / positions
    out = {"kv_pool_gib": cache.bytes() / gib,
           "kv_static_gib": engine.batch * engine.max_len * per_pos / gib}
    if paged:
        out.update(kv_block_size=cache.block_size, preemptions=engine.preemptions,
                   kv_used_gib=cache.peak_blocks * cache.block_size * per_pos / gib)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_fast_vs_generate(preset: str = "tiny", device: str = "cpu", dtype: str = "float32", batch: int = 16,
                           prompt_len: int = 16, new_tokens: int = 32, seed: int = 0,
                           bandwidth_tb_s: float | None = None, skip_generate: bool = False,
                           compile: bool | None = None, model_path: str | None = None, span_bucket: int = 128,
                           generate_tokens: int | None = None, kv_cache: str = "static", block_size: int = 16,
                           spread_lengths: bool = False, paged_attention: str = "gather",
                           experts: str = "auto", decode_attention: str = "auto") -> dict:
    """Tokens/s of :class:`FastHFEngine` and of ``model.generate()`` side by side; returns figures.

    ``model_path``: an HF folder instead of the random ``preset`` (e.g. SmolLM2); ``generate_tokens``:
    time plain ``generate()`` on this many new tokens only (default ``new_tokens``; it runs ~80 ms
    a step on the GPU, so thousands of steps do not fit a short run), reported as ``generate_new_tokens``.
    ``kv_cache``/``block_size``/``paged_attention``: the engine's KV memory (``kv_pool_gib`` allocated, ``kv_used_gib``
    at the peak, ``kv_static_gib`` what the static cache takes for the shape). ``spread_lengths``:
    response caps drawn uniformly from ``1..new_tokens`` per request (real responses end at
    different lengths); the fast path then counts the tokens it drew. ``experts``: the engine's
    ``experts_implementation`` ("auto", or a transformers name such as "grouped_mm" to A/B it);
    ``decode_attention``: the static cache's decode attention ("auto", "sdpa" or "flex").
    ``bandwidth_tb_s``: the memory bandwidth of the floor (default: the card's spec,
    :func:`spec_bandwidth_tb_s`; on a card not listed there the floor is left out).
    """
    for name, v in (("batch", batch), ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if v < 1:
            raise ValueError(f"{name} = {v}: must be >= 1")
    model = build_bench_model(preset, device, dtype, seed, path=model_path)
    no_eos = model.config.vocab_size  # never drawn: both paths decode exactly new_tokens
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, no_eos, (batch, prompt_len), generator=gen)
    out = {"preset": model_path or preset, "device": device, "span_bucket": span_bucket, "dtype": dtype,
           "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, **param_counts(model)}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    engine = FastHFEngine(model, None, FastHFConfig(
        device=device, batch_size=batch, max_seq_len=prompt_len + new_tokens, eos_token_id=no_eos, compile=compile,
        span_bucket=span_bucket, kv_cache=kv_cache, block_size=block_size, paged_attention=paged_attention,
        experts_implementation=experts, decode_attention=decode_attention))
    caps = torch.randint(1, new_tokens + 1, (batch,), generator=gen).tolist() if spread_lengths else None
    out.update(_time_fast(engine, prompts.tolist(), new_tokens, caps, device), spread_lengths=spread_lengths)
    if not skip_generate:
        out.update(_time_generate(model, prompts.to(device), generate_tokens or new_tokens, no_eos, device))
        out["ratio_vs_plain_generate"] = out["fast_tok_s"] / out["generate_tok_s"]
    if device.startswith("cuda") and bandwidth_tb_s is None:
        bandwidth_tb_s = spec_bandwidth_tb_s(out["gpu"])
    if device.startswith("cuda") and bandwidth_tb_s is not None:
        floor = bandwidth_floor(model, batch, prompt_len, new_tokens, bandwidth_tb_s * 1e12)
        out.update(floor, bandwidth_tb_s=bandwidth_tb_s, gap_to_floor=floor["floor_tok_s"] / out["fast_tok_s"])
    engine.close()
    return out


def _time_fast(engine: FastHFEngine, prompts: list[list[int]], new_tokens: int, caps: list[int] | None,
               device: str) -> dict:
    """One warm-up (graph captures) and one timed :meth:`FastHFEngine.generate` of ``prompts``
    (``[B][P]`` ids) at temperature 1; the fast path's figures."""
    out = {"experts": engine.experts_impl, "decode_attention": engine.decode_attention}
    t0 = time.perf_counter()
    engine.generate(prompts, new_tokens, 1.0)  # warm-up: captures the graphs
    _sync(device)
    out["fast_warmup_s"] = time.perf_counter() - t0
    engine.cache.peak_blocks = 0
    steps0, wait0 = engine.decode_steps, engine.sync_wait_s
    t0 = time.perf_counter()
    res = engine.generate(prompts, new_tokens, 1.0, max_tokens=caps)
    _sync(device)
    dt = time.perf_counter() - t0
    n_fast = sum(len(t) for t in res.tokens)
    steps = engine.decode_steps - steps0
    if device.startswith("cuda"):
        # The host's own time per decode step (launches, bookkeeping, prefills): the run's wall time
        # less its waits for the device. Below fast_step_ms the host runs ahead of the GPU.
        out["host_busy_ms_per_step"] = (dt - (engine.sync_wait_s - wait0)) / steps * 1e3
    kv_cache = engine.config.kv_cache
    out.update(fast_tokens=n_fast, fast_s=dt, fast_tok_s=n_fast / dt, fast_step_ms=dt / new_tokens * 1e3,
               decode_steps=steps, graphs_captured=engine.captures, compiled=engine.compiled, kv_cache=kv_cache,
               paged_attention=engine.config.paged_attention if kv_cache == "paged" else None, **kv_memory(engine))
    return out


def _time_generate(model, ids: torch.Tensor, new_tokens: int, no_eos: int, device: str) -> dict:
    """Plain ``model.generate()`` sampling ``new_tokens`` after ``ids [B, P]`` (one short warm-up first)."""
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              pad_token_id=0, eos_token_id=no_eos)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kw)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        seq = model.generate(ids, max_new_tokens=new_tokens, **kw)
        _sync(device)
    dt = time.perf_counter() - t0
    n_gen = int((seq.shape[1] - ids.shape[1]) * ids.shape[0])
    return {"generate_tokens": n_gen, "generate_new_tokens": seq.shape[1] - ids.shape[1], "generate_s": dt,
            "generate_tok_s": n_gen / dt}


def _generate_plain(model, prompts: list[list[int]], new_tokens: int, pad_id: int, no_eos: int, greedy: bool):
    """Plain ``model.generate()`` on left-padded ``prompts``: response ids ``[B, new_tokens]``."""
    width = max(len(q) for q in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, q in enumerate(prompts):
        ids[i, width - len(q):], attn[i, width - len(q):] = torch.tensor(q), 1
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        out = model.generate(ids.to(model.device), attention_mask=attn.to(model.device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad_id, eos_token_id=no_eos, **kw)
    return out[:, width:].cpu()


def bench_groups(engine, prompts: list[list[int]], group_size: int, new_tokens: int, repeats: int = 3) -> dict:
    """Shared-prompt groups in :class:`FastHFEngine` vs plain ``model.generate()``, same model and lengths.

    ``prompts`` are the distinct prompts; each is sampled ``group_size`` times (temperature 1,
    EOS off in both, so every response has ``new_tokens`` tokens). Fast and plain runs
    alternate ``repeats`` times after one warm-up each; ``ratio_vs_plain_generate`` is the
    ratio of median tokens/s (``..._cpu_time``: per second of process CPU time, which other
    processes on a shared CPU disturb less). ``greedy_tokens_equal``: greedy responses agree.
    """
    if not isinstance(engine, FastHFEngine):
        raise ValueError(f"bench_groups needs a FastHFEngine, not {type(engine).__name__}")
    model, device = engine.model, str(engine.device)
    flat = [q for q in prompts for _ in range(group_size)]
    if len(flat) > engine.batch:
        raise ValueError(f"{len(prompts)} prompts x group {group_size} > engine batch {engine.batch}")
    no_eos = model.config.vocab_size  # never drawn
    eos, engine.eos_id = engine.eos_id, no_eos
    try:
        engine.generate(flat, min(new_tokens, 8), 1.0)
        _generate_plain(model, flat, min(new_tokens, 8), engine.pad_id, no_eos, greedy=False)
        fast_tps, plain_tps, fast_cpu, plain_cpu = [], [], [], []
        prefill_before = engine.prefill_tokens
        for _ in range(repeats):
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            n = sum(len(t) for t in engine.generate(flat, new_tokens, 1.0).tokens)
            _sync(device)
            fast_tps.append(n / (time.perf_counter() - t0))
            fast_cpu.append(n / (time.process_time() - c0))
            t0, c0 = time.perf_counter(), time.process_time()
            n = _generate_plain(model, flat, new_tokens, engine.pad_id, no_eos, greedy=False).numel()
            _sync(device)
            plain_tps.append(n / (time.perf_counter() - t0))
            plain_cpu.append(n / (time.process_time() - c0))
        prefilled = (engine.prefill_tokens - prefill_before) // repeats
        fast_greedy = engine.generate(flat, new_tokens, 0.0).tokens
        plain_greedy = _generate_plain(model, flat, new_tokens, engine.pad_id, no_eos, greedy=True).tolist()
    finally:
        engine.eos_id = eos
    same = [a == b for a, b in zip(fast_greedy, plain_greedy)]
    fast, plain = statistics.median(fast_tps), statistics.median(plain_tps)
    return {"prompts": len(prompts), "group_size": group_size, "new_tokens": new_tokens, "repeats": repeats,
            "share_prompts": engine.share_prompts, "prompt_tokens": sum(len(q) for q in flat),
            "prompt_tokens_prefilled": prefilled, "fast_tok_s": round(fast, 1), "plain_generate_tok_s": round(plain, 1),
            "fast_tok_s_runs": [round(x, 1) for x in fast_tps], "plain_tok_s_runs": [round(x, 1) for x in plain_tps],
            "ratio_vs_plain_generate": round(fast / plain, 3),
            # tokens per second of this process's CPU time: steadier than wall time on a shared CPU
            "ratio_vs_plain_generate_cpu_time": round(statistics.median(fast_cpu) / statistics.median(plain_cpu), 3),
            "greedy_tokens_equal": all(same),
            "greedy_sequences_equal": f"{sum(same)}/{len(same)}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamrl.bench.hf_fast", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on cuda, else float32)")
    p.add_argument("--batch", type=int, default=None, help="default 16 (tiny) / 256 (moe-1b)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 16 (tiny) / 128 (moe-1b)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (tiny) / 256 (moe-1b)")
    p.add_argument("--bandwidth-tb-s", type=float, default=None,
                   help="memory bandwidth of the floor in TB/s (default: the card's spec; H200 4.8, H100 SXM 3.35)")
    p.add_argument("--skip-generate", action="store_true", help="time only the fast path")
    p.add_argument("--no-compile", action="store_true", help="capture the plain (uncompiled) decode step")
    p.add_argument("--model-path", default=None, help="HF folder to run instead of --preset (e.g. a SmolLM2 folder)")
    p.add_argument("--span-bucket", type=int, default=128, help="attended-span bucket of the CUDA graphs (one each)")
    p.add_argument("--generate-tokens", type=int, default=None, help="new tokens of the plain generate() run")
    p.add_argument("--kv-cache", default="static", choices=["static", "paged"], help="KV memory of the engine")
    p.add_argument("--block-size", type=int, default=16, help="positions per block of the paged cache")
    p.add_argument("--paged-attention", default="gather", choices=["gather", "flex"],
                   help="paged decode: gather blocks per layer, or FlexAttention over the pool in place")
    p.add_argument("--decode-attention", default="auto", choices=["auto", "sdpa", "flex"],
                   help="static cache: sdpa over the span bucket, or FlexAttention over each row's blocks (auto: flex on CUDA for >= 512 positions)")
    p.add_argument("--experts", default="auto", help="experts implementation of the engine (auto, grouped_mm, ...)")
    p.add_argument("--spread-lengths", action="store_true", help="response caps uniform in 1..new-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = p.parse_args(argv)
    big = a.preset == "moe-1b"
    try:
        res = bench_fast_vs_generate(
            preset=a.preset, device=a.device, dtype=a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"),
            batch=a.batch or (256 if big else 16), prompt_len=a.prompt_len or (128 if big else 16),
            new_tokens=a.new_tokens or (256 if big else 32), seed=a.seed, bandwidth_tb_s=a.bandwidth_tb_s,
            skip_generate=a.skip_generate, compile=False if a.no_compile else None, model_path=a.model_path,
            span_bucket=a.span_bucket, generate_tokens=a.generate_tokens, kv_cache=a.kv_cache,
            block_size=a.block_size, spread_lengths=a.spread_lengths, paged_attention=a.paged_attention,
            experts=a.experts, decode_attention=a.decode_attention)
    except ValueError as e:
        print(f"hf_fast bench: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
