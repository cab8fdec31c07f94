"""``streamrl-bench e2e``: asynchronous vs synchronous training, same config, same resources.

Runs ``streamrl-launch`` twice with identical config, code and process counts:

* **sync**: ``learner.max_staleness=0`` — admission control lets workers generate only for the
  current version, so the learner trains strictly on-policy and workers wait for each version.
  A synchronous trainer generates one step's groups at a time, so when the config's
  ``rollout.prompts_per_batch`` does not divide ``learner.groups_per_step`` (e.g. 256-sequence
  decode batches that only an asynchronous run can fill) the sync run splits one step's groups
  over the workers instead (:func:`sync_batch`; the result's ``sync_prompts_per_batch``);
* **async**: ``learner.max_staleness=k`` (default: the config's) with the configured off-policy correction.

Figures per run come from the run's own ``metrics.jsonl`` and ``summary.json``. With ``--json``
the last printed line is one JSON object with both runs and the ratios
``speedup_async_vs_sync`` (samples/s) and ``time_to_target_ratio`` (sync / async wall time to
reach ``--target`` reward). ``--repeats N`` (default 3) runs sync and async N times each,
alternately (sync, async, sync, ...: drift of a shared machine hits both alike); the figures
are then medians over the repeats, ``spread`` holds their min-max, ``speedup_async_vs_sync`` is
the ratio of the median samples/s (its spread: the min-max of the per-pair ratios) and
``runs`` the per-repeat figures; ``--merge A/result.json B/result.json ...`` combines the pairs
of several invocations of the same setup the same way (runs split over device calls). ``*_steady`` figures leave out the first fifth of the steps
(start-up: model load, compile, CUDA-graph capture), which the whole-run figures include. ``--ablation`` instead compares off-policy corrections at high
staleness (``--losses``, ``--ablation-staleness``) over ``--seeds``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from streamrl.config import load_config
from streamrl.monitor.report import split_rows


def parse_args(argv):
    p = argparse.ArgumentParser(prog="streamrl-bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--learners", type=int, default=1)
    p.add_argument("--rollers", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--staleness", type=int, default=None,
                   help="max_staleness of the async run (default: the config's, or 4 where the config's is 0)")
    p.add_argument("--repeats", type=int, default=3, help="sync/async pairs, run alternately; figures are medians")
    p.add_argument("--target", type=float, default=None,
                   help="reward target for time-to-target (default: 80%% of the sync run's final reward)")
    p.add_argument("--out", default="runs/bench-e2e", help="directory for runs, PNG and JSON")
    p.add_argument("--ablation", action="store_true", help="compare off-policy corrections instead")
    p.add_argument("--losses", default="grpo_no_correction,grpo_tis", help="ablation: comma-separated learner.loss values")
    p.add_argument("--ablation-staleness", type=int, default=8)
    p.add_argument("--seeds", type=int, default=1, help="ablation: seeds per loss")
    p.add_argument("--json", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="RESULT_JSON", default=None,
                   help="instead of running: merge result.json files of the same setup into one (medians over all pairs)")
    p.add_argument("overrides", nargs="*", help="config overrides for both runs")
    return p.parse_args(argv)


def run_once(args, name: str, overrides: list[str]) -> dict:
    """Launch one run; return its per-step records and summary."""
    run_dir = Path(args.out) / name
    cmd = [sys.executable, "-m", "streamrl.launcher.launch", "--config", args.config,
           "--learners", str(args.learners), "--rollers", str(args.rollers),
           "--steps", str(args.steps), "--run-dir", str(run_dir), *args.overrides, *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    # one row per learner step; an evaluator (eval.interval) appends its eval/* rows to the same file
    records, _ = split_rows([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": name, "records": records, "summary": summary, "launch_wall_s": time.time() - t0}


def sync_batch(prompts_per_batch: int, groups_per_step: int, rollers: int) -> int:
    """``rollout.prompts_per_batch`` of the sync run: the config's if it divides one step's groups,
    else one step's groups split evenly over the workers (else all of them in one batch)."""
    if groups_per_step % prompts_per_batch == 0:
        return prompts_per_batch
    return groups_per_step // rollers if groups_per_step % rollers == 0 else groups_per_step


def smoothed_rewards(records: list[dict], window: int = 5) -> list[float]:
    r = [rec["learner/reward_mean"] for rec in records]
    return [sum(r[max(0, i - window + 1): i + 1]) / len(r[max(0, i - window + 1): i + 1]) for i in range(len(r))]


def figures(run: dict, target: float) -> dict:
    """Throughput and time/samples to ``target`` (first step where the 5-step mean reaches it)."""
    recs, s = run["records"], run["summary"]
    wall = recs[-1]["wall_s"]
    samples = recs[-1]["learner/samples"]
    trained_tokens = sum(r["learner/trained_tokens"] for r in recs)
    idle = sum(r["learner/idle_s"] for r in recs)
    # the learner's warm-up (streamrl.learner.warmup) is work done before the first batch: busy
    busy = sum(r["learner/step_s"] + r.get("learner/warmup_s", 0.0) for r in recs)
    sm = smoothed_rewards(recs)
    hit = next((i for i, v in enumerate(sm) if v >= target), None)
    received_tokens = s["transport"].get("transport/response_tokens", None)
    k = max(1, len(recs) // 10)
    # steady state: from the end of the first fifth of the steps (start-up left out)
    first = recs[max(1, len(recs) // 5) - 1] if len(recs) > 1 else {"wall_s": 0.0, "learner/samples": 0}
    later = recs[max(1, len(recs) // 5):] or recs
    later_idle = sum(r["learner/idle_s"] for r in later)
    return {
        "samples_per_s": samples / wall,
        "samples_per_s_steady": (samples - first["learner/samples"]) / max(wall - first["wall_s"], 1e-9),
        "learner_idle_pct_steady": 100 * later_idle / max(later_idle + sum(r["learner/step_s"] for r in later), 1e-9),
        "trained_tokens_per_s": trained_tokens / wall,
        "generated_tokens_per_s": (received_tokens / wall) if received_tokens else trained_tokens / wall,
        "learner_idle_pct": 100 * idle / max(idle + busy, 1e-9),
        "wall_s": wall,
        # start-up: learner wall time until its first step is done (model load, the first batch, the
        # first step's compile); the whole-run figures include it, the steady ones do not
        "first_step_done_s": recs[0]["wall_s"],
        "samples": samples,
        "time_to_target_s": recs[hit]["wall_s"] if hit is not None else None,
        "samples_to_target": recs[hit]["learner/samples"] if hit is not None else None,
        "reward_first": s["reward_first"],
        "final_reward": sum(r["learner/reward_mean"] for r in recs[-k:]) / k,
        "samples_dropped_stale": s["samples_dropped_stale"],
        "staleness_mean": sum(r["learner/staleness_mean"] for r in recs) / len(recs),
    }


def median_figures(runs: list[dict]) -> dict:
    """Per-key median of :func:`figures` dicts (over the values that are not None; None if all are)."""
    out = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 (only --plot pays for matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        recs = run["records"]
        sm = smoothed_rewards(recs)
        axes[0].plot([r["wall_s"] for r in recs], sm, label=run["name"])
        axes[1].plot([r["learner/samples"] for r in recs], sm, label=run["name"])
    axes[0].set_xlabel("wall time (s)")
    axes[1].set_xlabel("trajectories trained")
    for ax in axes:
        ax.set_ylabel("reward (5-step mean)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ablation:
        return ablation(args, out)
    if args.merge:
        try:
            result = merge([json.loads(Path(f).read_text()) for f in args.merge])
        except (OSError, ValueError, KeyError) as e:
            print(f"--merge: {e}", file=sys.stderr)
            return 2
        (out / "result.json").write_text(json.dumps(result, indent=2))
        _print_table(result)
        if args.json:
            print(json.dumps(result))
        return 0
    if args.repeats < 1:
        print(f"--repeats = {args.repeats}: must be >= 1", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)  # a config error stops here, before any launch
    if args.staleness is None:
        args.staleness = cfg.learner.max_staleness or 4
    args.sync_ppb = sync_batch(cfg.rollout.prompts_per_batch, cfg.learner.groups_per_step, args.rollers)
    sync_overrides = ["learner.max_staleness=0", f"rollout.prompts_per_batch={args.sync_ppb}"]
    pairs = []
    for r in range(args.repeats):
        tag = f"-{r}" if args.repeats > 1 else ""
        pairs.append((run_once(args, f"sync{tag}", sync_overrides),
                      run_once(args, f"async{tag}", [f"learner.max_staleness={args.staleness}"])))
        # after every pair: a run cut short by a time limit keeps the pairs it finished
        result = summarize(args, pairs, out / "async_vs_sync.png")
        (out / "result.json").write_text(json.dumps(result, indent=2))
    _print_table(result)
    if args.json:
        print(json.dumps(result))
    return 0


def summarize(args, pairs: list[tuple[dict, dict]], png: Path) -> dict:
    """Result of ``(sync, async)`` run pairs (:func:`run_once`): medians, spreads, per-run figures, plot."""
    sync_final = statistics.median(figures(sync, float("inf"))["final_reward"] for sync, _ in pairs)
    target = args.target if args.target is not None else 0.8 * sync_final
    per = [(figures(sync, target), figures(asyn, target)) for sync, asyn in pairs]
    plot([run for pair in pairs for run in pair], png,
         f"async (k={args.staleness}) vs sync — {args.learners} learner(s), {args.rollers} roller(s)")
    meta = {"config": args.config, "learners": args.learners, "rollers": args.rollers, "steps": args.steps,
            "staleness": args.staleness, "target_reward": target,
            "sync_prompts_per_batch": getattr(args, "sync_ppb", None)}
    return {**combine(meta, per, [[sync["launch_wall_s"], asyn["launch_wall_s"]] for sync, asyn in pairs]),
            "png": str(png)}


def combine(meta: dict, per: list[tuple[dict, dict]], launch_walls: list[list[float]]) -> dict:
    """Result of ``(sync, async)`` :func:`figures` pairs: medians, min-max spreads, per-pair ratios."""
    fs, fa = median_figures([f for f, _ in per]), median_figures([f for _, f in per])
    ratios = [a["samples_per_s"] / b["samples_per_s"] for b, a in per]
    steady = [a["samples_per_s_steady"] / b["samples_per_s_steady"] for b, a in per]
    return {
        "benchmark": "e2e", **meta, "repeats": len(per),
        "sync": fs, "async": fa,
        "speedup_async_vs_sync": fa["samples_per_s"] / fs["samples_per_s"],
        "speedup_async_vs_sync_steady": fa["samples_per_s_steady"] / fs["samples_per_s_steady"],
        "time_to_target_ratio": (fs["time_to_target_s"] / fa["time_to_target_s"])
        if fs["time_to_target_s"] and fa["time_to_target_s"] else None,
        "final_reward_diff": fa["final_reward"] - fs["final_reward"],
        "spread": {
            "speedup_async_vs_sync": [min(ratios), max(ratios)],
            "speedup_async_vs_sync_steady": [min(steady), max(steady)],
            **{f"{k}_{name}": [min(f[i][k] for f in per), max(f[i][k] for f in per)]
               for k in ("samples_per_s", "learner_idle_pct", "samples_per_s_steady", "learner_idle_pct_steady")
               for i, name in ((0, "sync"), (1, "async"))},
        },
        "runs": [{"sync": b, "async": a, "speedup_async_vs_sync": x, "speedup_async_vs_sync_steady": y,
                  "launch_wall_s": w} for (b, a), x, y, w in zip(per, ratios, steady, launch_walls)],
    }


MERGE_KEYS = ("config", "learners", "rollers", "steps", "staleness", "sync_prompts_per_batch")
"""What the merged results must share (the runs must measure the same thing)."""


def merge(results: list[dict]) -> dict:
    """One result from several ``result.json`` of the same setup (e.g. one pair per device call):
    medians and spreads over all their pairs. Each pair keeps the time-to-target of its own call's
    target; the merged ``target_reward`` is their median."""
    for r in results[1:]:
        for k in MERGE_KEYS:
            if r.get(k) != results[0].get(k):
                raise ValueError(f"cannot merge: {k} = {r.get(k)!r} in one result, {results[0].get(k)!r} in another")
    runs = [run for r in results for run in r["runs"]]
    meta = {k: results[0].get(k) for k in MERGE_KEYS}
    meta["target_reward"] = statistics.median(r["target_reward"] for r in results)
    return combine(meta, [(run["sync"], run["async"]) for run in runs], [run["launch_wall_s"] for run in runs])


def ablation(args, out: Path) -> int:
    runs, table = [], {}
    for loss in args.losses.split(","):
        finals = []
        for seed in range(args.seeds):
            run = run_once(args, f"{loss}-s{seed}", [f"learner.max_staleness={args.ablation_staleness}",
                                                     f"learner.loss={loss}", f"run.seed={seed}"])
            finals.append(figures(run, float("inf"))["final_reward"])
            runs.append(run)
        table[loss] = {"final_rewards": finals, "mean_final_reward": sum(finals) / len(finals)}
    png = out / "ablation.png"
    plot(runs, png, f"off-policy correction at max_staleness={args.ablation_staleness}")
    result = {"benchmark": "e2e-ablation", "staleness": args.ablation_staleness, "losses": table, "png": str(png)}
    (out / "ablation.json").write_text(json.dumps(result, indent=2))
    for loss, row in table.items():
        print(f"{loss:<24} final reward {row['mean_final_reward']:.3f}  per seed {['%.3f' % f for f in row['final_rewards']]}")
    if args.json:
        print(json.dumps(result))
    return 0


def _print_table(result: dict) -> None:
    keys = ["samples_per_s", "samples_per_s_steady", "generated_tokens_per_s", "trained_tokens_per_s",
            "learner_idle_pct", "learner_idle_pct_steady", "wall_s", "first_step_done_s",
            "time_to_target_s", "samples_to_target", "reward_first", "final_reward", "samples_dropped_stale",
            "staleness_mean"]
    print(f"{'figure':<24}{'sync':>14}{'async':>14}")
    for k in keys:
        a, b = result["sync"][k], result["async"][k]
        fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"{k:<24}{fmt(a):>14}{fmt(b):>14}")
    sp = result["spread"]
    if result["repeats"] > 1:
        print(f"medians of {result['repeats']} runs each; spread (min-max): "
              f"samples_per_s sync {sp['samples_per_s_sync'][0]:.3f}-{sp['samples_per_s_sync'][1]:.3f}, "
              f"async {sp['samples_per_s_async'][0]:.3f}-{sp['samples_per_s_async'][1]:.3f}; learner_idle_pct "
              f"sync {sp['learner_idle_pct_sync'][0]:.1f}-{sp['learner_idle_pct_sync'][1]:.1f}, "
              f"async {sp['learner_idle_pct_async'][0]:.1f}-{sp['learner_idle_pct_async'][1]:.1f}; "
              f"speedup {sp['speedup_async_vs_sync'][0]:.2f}-{sp['speedup_async_vs_sync'][1]:.2f}")
    print(f"speedup_async_vs_sync {result['speedup_async_vs_sync']:.2f} (steady state "
          f"{result['speedup_async_vs_sync_steady']:.2f})  "
          f"time_to_target_ratio {result['time_to_target_ratio']}  (target {result['target_reward']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
