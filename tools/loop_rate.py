"""Samples/s of a finished (or stopped) run from its metrics.jsonl, warm-up steps left out.

    python tools/loop_rate.py runs/smol-dense [--skip 2]

``samples_per_s``: trained samples between the first kept learner step and the last, over
the wall time between them; also the learner's idle share and median step/compute seconds,
and with core lending on, the median share of a step the learner ran with a waiting worker's
threads (``lent_pct_median``) and the share the colocated workers were idle (``workers_idle_pct_median``),
and the median share of samples left out of the forward/backward for a zero advantage
(``dropped_zero_adv_pct_median``, ``learner.drop_zero_advantage``).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--skip", type=int, default=2, help="learner steps left out at the start (warm-up)")
    a = p.parse_args()
    rows = [json.loads(line) for line in (Path(a.run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in rows if "learner/samples" in r][a.skip:]
    if len(recs) < 2:
        raise SystemExit(f"{a.run_dir}: {len(recs)} learner steps after --skip {a.skip}; need 2")
    wall = recs[-1]["wall_s"] - recs[0]["wall_s"]
    samples = recs[-1]["learner/samples"] - recs[0]["learner/samples"]
    idle = sum(r.get("learner/idle_s", 0.0) for r in recs[1:])
    busy = sum(r.get("learner/step_s", 0.0) for r in recs[1:])
    out = {"samples_per_s": round(samples / wall, 3), "steps_measured": len(recs) - 1,
           "step_wall_s_median": round(statistics.median(b["wall_s"] - x["wall_s"] for x, b in zip(recs, recs[1:])), 2),
           "learner_compute_s_median": round(statistics.median(r.get("learner/compute_s", 0.0) for r in recs[1:]), 2),
           "learner_idle_pct": round(100 * idle / max(idle + busy, 1e-9), 1)}
    # core lending (placement.lend_idle_cores): share of each step the learner ran with a colocated
    # worker's threads, and the share of it the worker(s) sat idle (admission/backpressure)
    for key, name in (("learner/lent_frac", "lent_pct"), ("learner/workers_idle_frac", "workers_idle_pct"),
                      ("learner/dropped_zero_adv_frac", "dropped_zero_adv_pct")):
        vals = [r[key] for r in recs[1:] if key in r]
        if vals:
            out[f"{name}_median"] = round(100 * statistics.median(vals), 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
