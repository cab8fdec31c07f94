"""Staleness sweep: time-to-accuracy of the race's StreamRL side under fixed bounds 1, 2, 4, 8 and adaptive.

Each run is one ``streamrl-bench race --side streamrl`` (one per device call, see
tools/gpu/staleness_sweep.sh), whose ``streamrl.json`` holds the held-out accuracy curve
(base model, then 25/50/75/100 % of the budget, one evaluator). ``combine`` reads every
``DIR/<setting>-r<repeat>/streamrl.json`` and reports, in one JSON:

* the target accuracy: ``--target``, or ``--target-frac`` (0.9) of the best fixed setting's
  median final accuracy (a level every good setting reaches inside the budget, so times are
  comparable);
* per setting, each run's time to the target (linear between curve points, the race's rule;
  null when never reached) and final accuracy, their medians and min-max spreads (a run that
  never reaches the target counts as slower than every run that does);
* the best fixed bound (lowest median time) and ``adaptive_vs_best_fixed`` (adaptive's median
  time / the best fixed one's; <= 1.1 is "within 10 %"; null when the target is not above the
  base model's accuracy: nothing was learned to race for), plus the adaptive runs' bounds over
  time when their ``metrics.jsonl`` was kept.

    python tools/gpu/staleness_sweep.py overrides adaptive     # the config overrides of a setting
    python tools/gpu/staleness_sweep.py combine runs/sweep --json
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

from streamrl.bench.race_curve import time_to_accuracy

FIXED = (1, 2, 4, 8)
SETTINGS = {**{f"fixed{k}": [f"learner.max_staleness={k}", "learner.staleness=fixed"] for k in FIXED},
            "adaptive": [f"learner.max_staleness={max(FIXED)}", f"learner.staleness_min={min(FIXED)}",
                         "learner.staleness=adaptive"]}
RUN_DIR = re.compile(r"^(?P<setting>[a-z0-9]+)-r(?P<repeat>\d+)$")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overrides", help="print the config overrides of a setting, one line")
    o.add_argument("setting", choices=sorted(SETTINGS))
    c = sub.add_parser("combine", help="one JSON from the runs under DIR")
    c.add_argument("dir")
    c.add_argument("--target", type=float, default=None, help="target held-out accuracy (default: see --target-frac)")
    c.add_argument("--target-frac", type=float, default=0.9,
                   help="target = this share of the best fixed setting's median final accuracy")
    c.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def load_runs(root: Path) -> dict[str, list[dict]]:
    """``{setting: [{"repeat", "curve", "bounds"}]}`` from ``root/<setting>-r<k>/streamrl.json``."""
    runs: dict[str, list[dict]] = {}
    for side in sorted(root.glob("*/streamrl.json")):
        m = RUN_DIR.match(side.parent.name)
        if not m or m["setting"] not in SETTINGS:
            continue
        metrics = side.parent / "metrics.jsonl"
        bounds = ([json.loads(line).get("learner/staleness_bound") for line in metrics.read_text().splitlines()]
                  if metrics.is_file() else [])
        curve = json.loads(side.read_text())["curve"]
        runs.setdefault(m["setting"], []).append({"repeat": int(m["repeat"]), "curve": curve,
                                                  "bounds": [b for b in bounds if b is not None]})
    if not runs:
        raise ValueError(f"{root}: no <setting>-r<repeat>/streamrl.json (settings: {', '.join(SETTINGS)})")
    return runs


def _median_time(times: list[float | None]) -> float | None:
    """Median with never-reached runs as +inf; None when the median run never reached it."""
    med = statistics.median(math.inf if t is None else t for t in times)
    return None if math.isinf(med) else med


def setting_figures(runs: list[dict], target: float) -> dict:
    per = [{"repeat": r["repeat"], "time_to_target_s": time_to_accuracy(r["curve"], target),
            "final_accuracy": r["curve"][-1]["accuracy"], "final_stderr": r["curve"][-1].get("stderr")}
           for r in sorted(runs, key=lambda r: r["repeat"])]
    reached = [p["time_to_target_s"] for p in per if p["time_to_target_s"] is not None]
    finals = [p["final_accuracy"] for p in per]
    out = {"runs": per, "median_time_to_target_s": _median_time([p["time_to_target_s"] for p in per]),
           "time_spread_s": [min(reached), max(reached)] if reached else None, "reached": f"{len(reached)}/{len(per)}",
           "median_final_accuracy": statistics.median(finals), "final_spread": [min(finals), max(finals)]}
    bounds = [b for r in runs for b in r["bounds"]]
    if bounds:
        out["bound_mean"] = sum(bounds) / len(bounds)
        out["bound_last"] = [r["bounds"][-1] for r in runs if r["bounds"]]
    return out


def combine(root: Path, target: float | None, target_frac: float) -> dict:
    runs = load_runs(root)
    fixed = [s for s in SETTINGS if s.startswith("fixed") and s in runs]
    if target is None:
        if not fixed:
            raise ValueError(f"{root}: no fixed-bound runs to set the target from (give --target)")
        best_final = max(statistics.median(r["curve"][-1]["accuracy"] for r in runs[s]) for s in fixed)
        target = target_frac * best_final
    figures = {s: setting_figures(runs[s], target) for s in SETTINGS if s in runs}
    base = statistics.median(r["curve"][0]["accuracy"] for rs in runs.values() for r in rs)
    timed = [s for s in fixed if figures[s]["median_time_to_target_s"] is not None]
    best = min(timed, key=lambda s: figures[s]["median_time_to_target_s"]) if timed else None
    result = {"target_accuracy": target, "target_frac": target_frac, "base_accuracy": base,
              "target_above_base": target > base, "settings": figures, "best_fixed": best}
    adaptive = figures.get("adaptive", {}).get("median_time_to_target_s")
    if target <= base:  # the base model is already there: no time to compare
        result.update(adaptive_vs_best_fixed=None, adaptive_within_10pct=None)
    elif best is not None and adaptive is not None:
        ratio = adaptive / figures[best]["median_time_to_target_s"]
        result.update(adaptive_vs_best_fixed=ratio, adaptive_within_10pct=ratio <= 1.1)
    elif best is not None and "adaptive" in figures:
        result.update(adaptive_vs_best_fixed=None, adaptive_within_10pct=False)
    return result


def _print(result: dict) -> None:
    print(f"target held-out accuracy {result['target_accuracy']:.3f}")
    for name, f in result["settings"].items():
        t = f["median_time_to_target_s"]
        bound = f"  bound mean {f['bound_mean']:.2f}" if "bound_mean" in f else ""
        print(f"{name:<9} time-to-target {'never' if t is None else f'{t:.0f} s'} (reached {f['reached']})  "
              f"final {f['median_final_accuracy']:.3f}{bound}")
    if "adaptive_vs_best_fixed" in result:
        r = result["adaptive_vs_best_fixed"]
        print(f"adaptive / best fixed ({result['best_fixed']}): {'-' if r is None else f'{r:.2f}'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cmd == "overrides":
        print(" ".join(SETTINGS[args.setting]))
        return 0
    try:
        result = combine(Path(args.dir), args.target, args.target_frac)
    except ValueError as e:
        print(f"staleness_sweep: {e}", file=sys.stderr)
        return 2
    _print(result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
