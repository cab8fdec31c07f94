"""Side-by-side learner-step variants in ONE process, alternating, so machine load hits them alike.

Why: on a shared 2-core machine the load moves by 2x between runs minutes apart; the ratio of
two variants timed in alternation, round after round, is what holds. Each variant is a list of
``learner.*`` overrides applied to one Trainer's config (the same weights; gradients only, no
optimizer step, so every round sees the same model). Prints one JSON line per round and the
per-variant medians (wall and process CPU seconds).

    python tools/learner_ab.py --groups 4 --rounds 2 \\
        --variant b256=learner.max_tokens_per_microbatch=256 --variant b512=learner.max_tokens_per_microbatch=512

A ``threads=N`` entry in a variant sets torch's intra-op threads for that variant
(``--variant t1=threads=1 --variant t2=threads=2``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from streamrl.bench.learner import make_batch, make_config, parse_args as bench_args
from streamrl.bench.padded_reference import packed_gradients, padded_step
from streamrl.learner.trainer import Trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", action="append", default=[],
                   help="name=key=value[,key=value...] (learner.* overrides); 'padded' = the padded reference step")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    args = bench_args(["--groups", str(a.groups)])
    tr = Trainer(make_config(args, "shared"))
    batch = make_batch(tr.tokenizer, args)
    variants = {}
    for v in a.variant:
        name, _, spec = v.partition("=")
        variants[name] = [kv.split("=", 1) for kv in spec.split(",") if kv]
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for r in range(a.rounds + 1):  # round 0 warms up
        row = {"round": r, "load_1min": os.getloadavg()[0]}
        for name, kvs in variants.items():
            torch.set_num_threads(a.threads)
            for k, val in kvs:
                if k == "threads":
                    torch.set_num_threads(int(val))
                    continue
                sec, field = k.split(".", 1)
                cur = getattr(getattr(tr.cfg, sec), field)
                setattr(getattr(tr.cfg, sec), field, type(cur)(val == "true" if isinstance(cur, bool) else val))
            t0, c0 = time.perf_counter(), time.process_time()
            if name == "padded":
                padded_step(tr, batch, optimizer_step=False)
            else:
                packed_gradients(tr, batch)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            row[name] = round(dt, 2)
            if r:
                times[name].append((dt, dc))
        print(json.dumps(row), flush=True)
    print(json.dumps({k: {"wall_s": round(statistics.median(t[0] for t in v), 2),
                          "cpu_s": round(statistics.median(t[1] for t in v), 2)} for k, v in times.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
