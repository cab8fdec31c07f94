"""tools/gpu/staleness_sweep.py combine: time-to-accuracy per admission setting from race side JSONs."""
from __future__ import annotations

import json
import subprocess

import pytest

SWEEP = "tools/gpu/staleness_sweep.py"


def _side(root, name: str, accuracies: list[float], bounds: list[float] | None = None) -> None:
    """A race side JSON with points at 0, 60, 120, 180, 240 s."""
    d = root / name
    d.mkdir(parents=True)
    curve = [{"fraction": i / 4, "time_s": 60.0 * i, "accuracy": a, "stderr": 0.02} for i, a in enumerate(accuracies)]
    (d / "streamrl.json").write_text(json.dumps({"side": "streamrl", "curve": curve}))
    if bounds is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps({"learner/staleness_bound": b}) + "\n" for b in bounds))


def _combine(python, repo, root, *args) -> subprocess.CompletedProcess:
    return subprocess.run([python, SWEEP, "combine", str(root), "--json", *args], cwd=repo, capture_output=True,
                          text=True, timeout=60)


def test_combine_medians_best_fixed_and_adaptive_ratio(tmp_path, repo, python):
    for r, final in enumerate((0.40, 0.42, 0.38)):
        _side(tmp_path, f"fixed2-r{r}", [0.1, 0.2, 0.3, 0.4, final])
    for r in range(3):
        _side(tmp_path, f"fixed8-r{r}", [0.1, 0.1, 0.2, 0.3, 0.35])
        _side(tmp_path, f"adaptive-r{r}", [0.1, 0.25, 0.35, 0.4, 0.41], bounds=[4, 3, 3, 2])
    _side(tmp_path, "notes-r0", [0.0, 1.0, 1.0, 1.0, 1.0])  # not a setting: ignored
    p = _combine(python, repo, tmp_path)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.splitlines()[-1])
    target = 0.9 * 0.40  # the best fixed setting's median final accuracy
    assert res["target_accuracy"] == pytest.approx(target)
    # linear between the points around the target: fixed2 0.3 at 120 s, 0.4 at 180 s
    fixed2 = 120 + (target - 0.3) / (0.4 - 0.3) * 60
    adaptive = 60 + (target - 0.25) / (0.35 - 0.25) * 60 if target <= 0.35 else 120 + (target - 0.35) / 0.05 * 60
    assert res["settings"]["fixed2"]["median_time_to_target_s"] == pytest.approx(fixed2)
    assert res["settings"]["fixed8"]["median_time_to_target_s"] is None  # never reaches 0.36
    assert res["settings"]["fixed8"]["reached"] == "0/3"
    assert res["best_fixed"] == "fixed2"
    assert res["adaptive_vs_best_fixed"] == pytest.approx(adaptive / fixed2)
    assert res["adaptive_within_10pct"] == (adaptive / fixed2 <= 1.1)
    assert res["settings"]["adaptive"]["bound_mean"] == pytest.approx(3.0)


def test_overrides_and_errors(tmp_path, repo, python):
    p = subprocess.run([python, SWEEP, "overrides", "adaptive"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "learner.staleness=adaptive" in p.stdout and "learner.max_staleness=8" in p.stdout
    p = _combine(python, repo, tmp_path)
    assert p.returncode == 2 and "no <setting>-r<repeat>/streamrl.json" in p.stderr
