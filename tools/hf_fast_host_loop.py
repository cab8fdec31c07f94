"""Host (Python) seconds per decode step of ``FastHFEngine.generate``, the device work left out.

The decode step itself (``engine.decode_step``: one graph replay on a GPU) is replaced by three small
tensor ops that advance ``gen`` and set ``done`` at the cap, so
what is timed is the loop's own bookkeeping per step: slot state, spans, paged block growth,
versions and the periodic ``done`` read. Prefills and the stand-in step are timed separately and subtracted. On a GPU
this is the host time that must hide behind each replay.

    python tools/hf_fast_host_loop.py --batch 256 --new-tokens 256 --kv static
    python tools/hf_fast_host_loop.py --batch 256 --new-tokens 256 --kv paged --versions
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from streamrl.bench.hf_fast import build_bench_model
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig


def host_ms_per_step(batch: int, new_tokens: int, kv: str, versions: bool, repeats: int = 3) -> dict:
    model = build_bench_model("tiny", "cpu", "float32")
    eng = FastHFEngine(model, None, FastHFConfig(batch_size=batch, max_seq_len=16 + new_tokens, eos_token_id=64,
                                                 kv_cache=kv))
    steps, prefill_s = [0], [0.0]  # prefill_s: prefills and stand-in steps, left out of the figure

    def step(span, greedy):  # the model left out: only the counters a real step advances (timed apart)
        t0 = time.perf_counter()
        steps[0] += 1
        eng.gen.add_(1)
        eng.done.logical_or_(eng.gen >= eng.max_new)
        prefill_s[0] += time.perf_counter() - t0

    eng.decode_step = step

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                prefill_s[0] += time.perf_counter() - t0
        return run

    eng.prefill = timed(eng.prefill)
    prompts = torch.randint(3, 64, (batch, 16), generator=torch.Generator().manual_seed(0)).tolist()
    between = (lambda: None) if versions else None
    per_step = []
    for _ in range(repeats):
        steps[0], prefill_s[0] = 0, 0.0
        t0 = time.perf_counter()
        eng.generate(prompts, new_tokens, 1.0, between_steps=between)
        per_step.append((time.perf_counter() - t0 - prefill_s[0]) / steps[0] * 1e3)
    return {"batch": batch, "new_tokens": new_tokens, "kv_cache": kv, "versions": versions, "steps": steps[0],
            "host_ms_per_step": round(min(per_step), 4), "host_ms_per_step_runs": [round(x, 4) for x in per_step]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kv", default="static", choices=["static", "paged"])
    p.add_argument("--versions", action="store_true", help="pass a between_steps callback (per-token versions)")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(host_ms_per_step(a.batch, a.new_tokens, a.kv, a.versions)))


if __name__ == "__main__":
    main()
