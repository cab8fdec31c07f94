"""streamrl-report: PNGs with non-empty curves and the data behind them, text summary, errors."""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from streamrl.monitor.report import PLOTS, build_report, load_metrics, main


def write_run(run_dir, steps=40):
    """metrics.jsonl and summary.json shaped like the learner's (keys from workers/learner.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    t, rows = 1000.0, []
    for s in range(1, steps + 1):
        t += 0.2 + 0.05 * (s % 3)
        rows.append({
            "learner/step": s, "learner/samples": 256 * s, "learner/trained_tokens": 1500 + s,
            "learner/reward_mean": 0.01 + 0.005 * s, "learner/step_s": 0.15, "learner/idle_s": 0.05,
            "learner/idle_frac": 0.25, "learner/staleness_mean": min(s - 1, 4),
            "learner/samples_dropped_stale": 0 if s < 20 else 16, "learner/staleness_hist/0": 256.0,
            "weights/write_s": 0.01, "weights/bytes": 528128.0,
            "moe/router_entropy/layer0": 0.98 - s / 1000, "moe/expert_usage_std/layer0": 1.1,
            "moe/router_entropy/layer1": 0.99, "moe/expert_usage_std/layer1": 0.4,
            "transport/trajectories": 256 * s + 128, "transport/rejected": 0, "time": t, "wall_s": t - 1000,
        })
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn": ')
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "completed", "steps": steps, "samples": 256 * steps, "wall_s": t - 1000,
        "staleness_histogram": {"0": 256, "1": 512, "4": 9000}, "samples_dropped_stale": 16}))
    return rows


def test_report_pngs_show_the_run(tmp_path):
    rows = write_run(tmp_path / "run")
    rep = build_report(tmp_path / "run")
    import matplotlib.image as mpimg

    for name in PLOTS:
        png = tmp_path / "run" / "report" / f"{name}.png"
        img = mpimg.imread(png)
        # non-blank: a real plot has many pixels that are neither white nor one flat colour
        ink = (img[..., :3].sum(-1) < 2.5).mean()
        assert ink > 0.01, f"{name}.png looks empty ({ink:.4f} ink)"
        series = rep["data"][name]
        assert series, f"{name}: no series"
        for label, (xs, ys) in series.items():
            assert len(xs) == len(ys) > 0, (name, label)
            assert all(math.isfinite(v) for v in xs + ys), (name, label)
    d = rep["data"]
    assert d["reward"]["reward vs samples"] == ([256.0 * s for s in range(1, 41)],
                                                [r["learner/reward_mean"] for r in rows])
    assert d["staleness"]["lag histogram"] == ([0.0, 1.0, 4.0], [256.0, 512.0, 9000.0])
    # rolling rates over the real timestamps: 256 samples per step
    xs, ys = d["throughput"]["trained trajectories/s"]
    span = rows[-1]["time"] - rows[-4]["time"]
    assert ys[-1] == pytest.approx(3 * 256 / span)
    assert set(d["moe"]) == {"router entropy L0", "expert usage std L0", "router entropy L1", "expert usage std L1"}
    saved = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    assert saved["plots"]["reward"]["reward vs time"][1] == d["reward"]["reward vs time"][1]
    text = (tmp_path / "run" / "report" / "summary.txt").read_text()
    assert "steps 40" in text and "reward 0.0" in text and "MoE final" in text and "completed" in text


def test_load_skips_torn_line(tmp_path):
    write_run(tmp_path / "run", steps=3)
    assert len(load_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


def test_cli_errors_and_output(tmp_path, python, capsys):
    p = subprocess.run([python, "-m", "streamrl.monitor.report", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no metrics.jsonl" in p.stderr
    write_run(tmp_path / "run", steps=5)
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "o")]) == 0  # in-process: matplotlib is loaded
    assert "steps 5" in capsys.readouterr().out and (tmp_path / "o" / "moe.png").stat().st_size > 5000


def test_eval_rows_are_plotted_apart_from_learner_steps(tmp_path):
    """The evaluator appends eval/* rows to the same metrics.jsonl: they are no learner steps."""
    write_run(tmp_path / "run", steps=20)
    evals = [{"eval/version": v, "eval/accuracy": a, "time": 1000.0 + v} for v, a in ((0, 0.16), (10, 0.3), (20, 0.42))]
    with open(tmp_path / "run" / "metrics.jsonl", "r+") as f:
        text = f.read().rsplit("\n", 1)[0] + "\n"  # drop the torn tail, then interleave eval rows
        lines = text.splitlines()
        lines[5:5] = [json.dumps(evals[0])]
        lines.extend(json.dumps(e) for e in evals[1:])
        f.seek(0)
        f.write("\n".join(lines) + "\n")
        f.truncate()
    rep = build_report(tmp_path / "run")
    assert rep["data"]["reward"]["held-out accuracy vs version"] == ([0.0, 10.0, 20.0], [0.16, 0.3, 0.42])
    assert len(rep["data"]["reward"]["reward vs samples"][0]) == 20
    assert "steps 20," in rep["summary"]
    assert "held-out accuracy 0.16 at version 0 -> 0.42 at version 20 (best 0.42, 3 evaluations)" in rep["summary"]
