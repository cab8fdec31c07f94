"""hf_fast's CPU decode with and without one of its CPU measures, alternated in one process.

    python tools/hf_fast_cpu_ab.py [--what sampler|live-rows] [--config configs/smol-dense.yaml] [--repeats 3]

One worker batch of the config (SmolLM2-135M: 8 prompts x 8 samples, <= 24 tokens) at one
intra-op thread, same seeds, run with the measure on and off; prints the batch seconds of each
and checks the tokens and log-probs are identical (``live-rows``: of a greedy batch, since leaving
rows out changes how many random numbers a step draws, so sampled tokens differ; ``mean_len``
shows the timed batches did the same amount of work):

* ``sampler``: ``engine.noise`` (the ``[2, B, V]`` scratch: log-probs and noise, the draw in
  place in the logits) against fresh temporaries per step;
* ``live-rows``: eager decode steps of the live rows only (``FastHFEngine._live_rows``) against
  every step running all ``B`` rows, finished ones included.
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
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks import build_task
from streamrl.tasks.sources import build_prompt_source


def switches(eng, what: str):
    """``{"on": apply, "off": apply}`` for the measure ``what`` of engine ``eng``."""
    if what == "sampler":
        if eng.noise is None:
            raise SystemExit("the engine keeps no sampler buffers (not hf_fast on CPU)")
        scratch = eng.noise
        return {"off": lambda: setattr(eng, "noise", None), "on": lambda: setattr(eng, "noise", scratch)}
    live_rows = eng._live_rows
    return {"off": lambda: setattr(eng, "_live_rows", lambda: None), "on": lambda: setattr(eng, "_live_rows", live_rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--what", default="sampler", choices=("sampler", "live-rows"))
    p.add_argument("--config", default="configs/smol-dense.yaml")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config)
    rc = cfg.rollout
    model, tok = load_model_and_tokenizer(cfg.model, seed=0)
    eng = build_engine(cfg, model, tok)
    modes = switches(eng, a.what)
    src = build_prompt_source(cfg, build_task(cfg.task), 1, 0, 1)
    enc = PromptEncoder(tok, rc.chat_template)
    prompts = [enc.problem(q) for q in [next(src) for _ in range(rc.prompts_per_batch)] for _ in range(rc.group_size)]
    eng.generate(prompts, rc.max_new_tokens, rc.temperature)  # warm-up
    sampled_identical = a.what == "sampler"
    if not sampled_identical:
        greedy = {}
        for mode, apply in modes.items():
            apply()
            g = eng.generate(prompts, rc.max_new_tokens, 0.0)
            greedy[mode] = (g.tokens, g.logprobs)
        if greedy["off"] != greedy["on"]:
            raise SystemExit("greedy: tokens or log-probs differ")
    secs: dict[str, list[float]] = {m: [] for m in modes}
    lens: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(a.repeats):
        outs = {}
        for mode, apply in modes.items():
            apply()
            torch.manual_seed(rep)
            t0 = time.perf_counter()
            g = eng.generate(prompts, rc.max_new_tokens, rc.temperature)
            secs[mode].append(time.perf_counter() - t0)
            lens[mode].append(statistics.mean(len(t) for t in g.tokens))
            outs[mode] = (g.tokens, g.logprobs)
        if sampled_identical and outs["off"] != outs["on"]:
            raise SystemExit(f"repeat {rep}: tokens or log-probs differ")
    modes["on"]()
    print(json.dumps({"what": a.what, "batch_s": {k: [round(x, 2) for x in v] for k, v in secs.items()},
                      "median_s": {k: round(statistics.median(v), 2) for k, v in secs.items()},
                      "mean_len": {k: round(statistics.mean(v), 1) for k, v in lens.items()},
                      "identical": True}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
