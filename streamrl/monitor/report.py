"""``streamrl-report RUN_DIR``: PNG plots and a short text summary of a finished (or running) run.

Reads ``RUN_DIR/metrics.jsonl`` (one line per learner step, plus the evaluator's ``eval/*`` rows
when ``eval.interval`` is set) and ``summary.json`` if present;
writes into ``RUN_DIR/report/`` (or ``--out``): ``reward.png`` (vs samples and vs time),
``throughput.png``, ``staleness.png``, ``weights.png``, ``moe.png``, ``summary.txt`` and
``report.json`` (the exact series drawn, so scripts and tests can check what the plots show).
Headless: matplotlib's Agg backend, no display needed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from streamrl.monitor.snapshot import LAYER_RE, Thresholds

def load_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"streamrl-report: {path}:{i + 1}: unreadable line skipped", file=sys.stderr)
    return rows


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(learner step rows, evaluation rows): the evaluator appends its rows to the same file."""
    return [r for r in rows if "learner/step" in r], [r for r in rows if "eval/version" in r]


def col(rows: list[dict], key: str, x: str = "learner/step") -> tuple[list[float], list[float]]:
    """(xs, ys) over rows that carry both keys with finite values."""
    xs, ys = [], []
    for r in rows:
        a, b = r.get(x), r.get(key)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b):
            xs.append(float(a))
            ys.append(float(b))
    return xs, ys


def rolling_rate(rows: list[dict], key: str, window: int) -> tuple[list[float], list[float]]:
    """Rate of cumulative ``key`` per second over ``window`` steps, at each step's wall time."""
    ts, vs = col(rows, key, x="time")
    t0 = ts[0] if ts else 0.0
    xs, ys = [], []
    for i in range(window, len(ts)):
        dt = ts[i] - ts[i - window]
        if dt > 0:
            xs.append(ts[i] - t0)
            ys.append((vs[i] - vs[i - window]) / dt)
    return xs, ys


def cumulative(rows: list[dict], key: str) -> list[dict]:
    """Rows with ``key + '_cum'`` (running sum of a per-step count) added."""
    total, out = 0.0, []
    for r in rows:
        total += float(r.get(key, 0.0))
        out.append({**r, key + "_cum": total})
    return out


def build_data(rows: list[dict], summary: dict | None) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Every series per plot: {plot: {label: (xs, ys)}}."""
    rows, evals = split_rows(rows)
    t0 = rows[0].get("time", 0.0) - rows[0].get("learner/step_s", 0.0) if rows else 0.0
    rows = [{**r, "rel_time": r.get("time", t0) - t0} for r in cumulative(rows, "learner/trained_tokens")]
    w = max(1, min(len(rows) - 1, max(3, len(rows) // 15)))  # smooths bursty arrivals
    data: dict = {p: {} for p in PLOTS}
    data["reward"]["reward vs samples"] = col(rows, "learner/reward_mean", x="learner/samples")
    data["reward"]["reward vs time"] = col(rows, "learner/reward_mean", x="rel_time")
    data["reward"]["held-out accuracy vs version"] = col(evals, "eval/accuracy", x="eval/version")
    data["throughput"]["trained trajectories/s"] = rolling_rate(rows, "learner/samples", w)
    data["throughput"]["trained tokens/s"] = rolling_rate(rows, "learner/trained_tokens_cum", w)
    data["throughput"]["received trajectories/s"] = rolling_rate(rows, "transport/trajectories", w)
    data["throughput"]["learner step s"] = col(rows, "learner/step_s")
    data["throughput"]["learner idle fraction"] = col(rows, "learner/idle_frac")
    data["staleness"]["mean lag per step"] = col(rows, "learner/staleness_mean")
    data["staleness"]["dropped stale (cumulative)"] = col(rows, "learner/samples_dropped_stale")
    hist = (summary or {}).get("staleness_histogram") or {
        k.rsplit("/", 1)[1]: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("learner/staleness_hist/")}
    lags = sorted(hist, key=int)
    data["staleness"]["lag histogram"] = ([float(k) for k in lags], [float(hist[k]) for k in lags])
    for key in ("weights/gather_s", "weights/write_s", "weights/publish_s"):
        data["weights"][key] = col(rows, key)
    layers = sorted({int(m.group(1)) for r in rows[-1:] for k in r if (m := LAYER_RE.match(k))})
    for i in layers:
        data["moe"][f"router entropy L{i}"] = col(rows, f"moe/router_entropy/layer{i}")
        data["moe"][f"expert usage std L{i}"] = col(rows, f"moe/expert_usage_std/layer{i}")
    if not layers:
        data["moe"]["router entropy"] = col(rows, "moe/router_entropy")
        data["moe"]["expert usage std"] = col(rows, "moe/expert_usage_std")
    return {p: {k: v for k, v in d.items() if v[0]} for p, d in data.items()}


Series = dict[str, tuple[list[float], list[float]]]


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend. Lazy: matplotlib takes seconds to import
    and only the report draws; ``build_data`` and ``--help`` do without it."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt


def _line(ax, series: Series, label: str, **kw) -> None:
    if label in series:
        ax.plot(*series[label], label=label, **kw)


def _draw_reward(plt, series: Series):
    evals = "held-out accuracy vs version" in series
    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16 if evals else 11, 4))
    _line(axes[0], series, "reward vs samples")
    axes[0].set(xlabel="trained samples", ylabel="reward mean", title="reward vs samples")
    _line(axes[1], series, "reward vs time", color="tab:orange")
    axes[1].set(xlabel="seconds since first step", ylabel="reward mean", title="reward vs time")
    if evals:
        _line(axes[2], series, "held-out accuracy vs version", color="tab:green", marker="o")
        axes[2].set(xlabel="policy version", ylabel="greedy accuracy", title="held-out evaluation")
    return fig, axes


def _draw_throughput(plt, series: Series):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _line(axes[0], series, "trained trajectories/s")
    _line(axes[0], series, "received trajectories/s", linestyle="--")
    _line(axes[1], series, "trained tokens/s", color="tab:green")
    _line(axes[2], series, "learner step s")
    _line(axes[2], series, "learner idle fraction")
    axes[0].set(xlabel="seconds", title="trajectories/s")
    axes[1].set(xlabel="seconds", title="trained tokens/s")
    axes[2].set(xlabel="step", title="learner step time / idle")
    return fig, axes


def _draw_staleness(plt, series: Series):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _line(axes[0], series, "mean lag per step")
    axes[0].set(xlabel="step", ylabel="versions", title="mean version lag of trained tokens")
    if "lag histogram" in series:
        axes[1].bar(*series["lag histogram"], color="tab:purple")
    axes[1].set(xlabel="version lag", ylabel="trajectories", title="staleness histogram")
    _line(axes[2], series, "dropped stale (cumulative)", color="tab:red")
    axes[2].set(xlabel="step", title="trajectories dropped as stale")
    return fig, axes


def _draw_weights(plt, series: Series):
    fig, ax = plt.subplots(figsize=(8, 4))
    for label in series:
        ax.plot(*series[label], marker=".", label=label)
    ax.set(xlabel="step", ylabel="seconds", title="weight sync time (learner side)")
    return fig, [ax]


def _draw_moe(plt, series: Series):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for label in series:
        ax = axes[0] if "entropy" in label else axes[1]
        ax.plot(*series[label], label=label)
    axes[0].set(xlabel="step", ylabel="H / log E", title="router entropy (1 = uniform)")
    axes[1].set(xlabel="step", ylabel="std × E", title="expert usage std (0 = balanced)")
    th = Thresholds()  # streamrl-monitor's default warn / bad levels
    for y, c in ((th.usage_std_warn, "orange"), (th.usage_std_bad, "red")):
        axes[1].axhline(y, color=c, linestyle=":", linewidth=1)
    return fig, axes


_DRAW = {"reward": _draw_reward, "throughput": _draw_throughput, "staleness": _draw_staleness,
         "weights": _draw_weights, "moe": _draw_moe}
PLOTS = tuple(_DRAW)


def plot(name: str, series: Series):
    """One figure per plot name; returns the matplotlib Figure (Agg)."""
    if name not in _DRAW:
        raise ValueError(f"plot name {name!r}: expected one of {PLOTS}")
    fig, axes = _DRAW[name](_pyplot(), series)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def summary_text(run_dir: Path, rows: list[dict], summary: dict | None) -> str:
    rows, evals = split_rows(rows)
    s = summary or {}
    last = rows[-1] if rows else {}
    wall = s.get("wall_s", last.get("wall_s"))
    samples = s.get("samples", last.get("learner/samples"))
    tokens = sum(float(r.get("learner/trained_tokens", 0.0)) for r in rows)
    step_s = [r["learner/step_s"] for r in rows if "learner/step_s" in r]
    idle = sum(r.get("learner/idle_s", 0.0) for r in rows)
    busy = sum(step_s) + sum(r.get("learner/warmup_s", 0.0) for r in rows)  # streamrl.learner.warmup: busy

    def f(v, spec=".3g"):
        return "-" if v is None else format(v, spec)
    lines = [f"run {run_dir} ({s.get('status', 'no summary.json: running or killed')})",
             f"steps {len(rows)}, samples {f(samples, '.0f')}, wall {f(wall, '.1f')} s"]
    if wall:
        lines.append(f"throughput {f((samples or 0) / wall)} trajectories/s, {f(tokens / wall)} trained tokens/s")
    k = max(1, len(rows) // 10)
    rewards = [r["learner/reward_mean"] for r in rows if "learner/reward_mean" in r]
    if rewards:
        lines.append(f"reward {f(statistics.fmean(rewards[:k]))} -> {f(statistics.fmean(rewards[-k:]))} "
                     f"(mean of first / last {k} steps), best step {f(max(rewards))}")
    if step_s:
        lines.append(f"learner step {1000 * statistics.median(step_s):.1f} ms median, "
                     f"idle {100 * idle / max(idle + busy, 1e-9):.0f} % of the time")
    if evals:
        acc = [r["eval/accuracy"] for r in evals]
        lines.append(f"held-out accuracy {f(acc[0])} at version {evals[0]['eval/version']} -> {f(acc[-1])} at "
                     f"version {evals[-1]['eval/version']} (best {f(max(acc))}, {len(evals)} evaluations)")
    hist = s.get("staleness_histogram")
    lines.append(f"staleness: mean lag {f(statistics.fmean([r['learner/staleness_mean'] for r in rows if 'learner/staleness_mean' in r] or [0]))}"
                 f", histogram {hist if hist else '-'}, dropped stale {f(s.get('samples_dropped_stale', last.get('learner/samples_dropped_stale')))}")
    pubs = [r for r in rows if "weights/write_s" in r]
    if pubs:
        ws = [r["weights/write_s"] for r in pubs]
        nbytes = pubs[-1].get("weights/bytes", 0.0)
        lines.append(f"weights: {len(pubs)} syncs logged, write {1000 * statistics.median(ws):.1f} ms median "
                     f"({nbytes / max(statistics.median(ws), 1e-9) / 1e9:.2f} GB/s for {nbytes / 1e6:.1f} MB)")
    moe = [(k.rsplit("layer", 1)[1], v) for k, v in last.items() if k.startswith("moe/router_entropy/layer")]
    if moe:
        lines.append("MoE final: " + ", ".join(
            f"L{i} entropy {v:.3f} usage std {last.get(f'moe/expert_usage_std/layer{i}', float('nan')):.3f}" for i, v in moe))
    tr = s.get("transport") or {k: v for k, v in last.items() if k.startswith("transport/")}
    if tr:
        lines.append("transport: " + ", ".join(f"{k.split('/', 1)[1]} {v:g}" for k, v in tr.items()
                                               if k.split('/', 1)[1] in ("trajectories", "rejected", "duplicates", "seq_gaps")))
    return "\n".join(lines) + "\n"


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write the PNGs, summary.txt and report.json; returns {"files", "data", "summary"}.

    Raises ValueError naming the path when there is no metrics.jsonl or it holds no steps.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"run dir {str(run_dir)!r}: no metrics.jsonl (has the learner run a step?)")
    rows = load_metrics(path)
    if not split_rows(rows)[0]:
        raise ValueError(f"{path}: no learner steps recorded yet")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else None
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    data = build_data(rows, summary)
    files = []
    for name in PLOTS:
        fig = plot(name, data[name])
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        files.append(str(out / f"{name}.png"))
    text = summary_text(run_dir, rows, summary)
    (out / "summary.txt").write_text(text)
    (out / "report.json").write_text(json.dumps({"plots": data, "summary": text}))
    return {"files": files + [str(out / "summary.txt"), str(out / "report.json")], "data": data, "summary": text}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="streamrl-report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="run directory (with metrics.jsonl)")
    p.add_argument("--out", help="output directory (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        rep = build_report(args.run_dir, args.out)
    except ValueError as e:
        print(f"streamrl-report: {e}", file=sys.stderr)
        return 2
    print(rep["summary"], end="")
    print("wrote " + ", ".join(rep["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
