"""The hf_fast CPU sampler with and without its reused buffers, alternated in one process.

    python tools/hf_fast_sampler_ab.py [--config configs/smol-dense.yaml] [--repeats 3]

One worker batch of the config (SmolLM2-135M: 8 prompts x 8 samples, <= 24 tokens) at one
intra-op thread, run with ``engine.noise`` (the ``[2, B, V]`` scratch: log-probs and noise,
the draw in place in the logits) and without it (fresh temporaries per step), same seeds;
prints the batch seconds of each and checks the tokens and log-probs are identical.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from streamrl.config import load_config
from streamrl.engines.factory import build_engine
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.tasks import build_task
from streamrl.tasks.prompts import PromptEncoder
from streamrl.tasks.sources import build_prompt_source


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smol-dense.yaml")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config)
    rc = cfg.rollout
    model, tok = load_model_and_tokenizer(cfg.model, seed=0)
    eng = build_engine(cfg, model, tok)
    if eng.noise is None:
        raise SystemExit("the engine keeps no sampler buffers (not hf_fast on CPU)")
    src = build_prompt_source(cfg, build_task(cfg.task), 1, 0, 1)
    enc = PromptEncoder(tok, rc.chat_template)
    prompts = [enc.problem(q) for q in [next(src) for _ in range(rc.prompts_per_batch)] for _ in range(rc.group_size)]
    scratch = eng.noise
    eng.generate(prompts, rc.max_new_tokens, rc.temperature)  # warm-up
    secs: dict[str, list[float]] = {"fresh": [], "scratch": []}
    for rep in range(a.repeats):
        outs = {}
        for mode in secs:
            eng.noise = scratch if mode == "scratch" else None
            torch.manual_seed(rep)
            t0 = time.perf_counter()
            g = eng.generate(prompts, rc.max_new_tokens, rc.temperature)
            secs[mode].append(time.perf_counter() - t0)
            outs[mode] = (g.tokens, g.logprobs)
        if outs["fresh"] != outs["scratch"]:
            raise SystemExit(f"repeat {rep}: tokens or log-probs differ")
    eng.noise = scratch
    print(json.dumps({"batch_s": {k: [round(x, 2) for x in v] for k, v in secs.items()},
                      "median_s": {k: round(statistics.median(v), 2) for k, v in secs.items()},
                      "identical": True}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
