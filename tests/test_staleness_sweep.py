"""tools/gpu/staleness_sweep.py combine: time-to-accuracy per admission setting from race side JSONs."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

# a tool script, not a package module: loaded from its file
_spec = importlib.util.spec_from_file_location(
    "staleness_sweep", Path(__file__).resolve().parents[1] / "tools/gpu/staleness_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def _side(root, name: str, accuracies: list[float], bounds: list[float] | None = None) -> None:
    """A race side JSON with points at 0, 60, 120, 180, 240 s."""
    d = root / name
    d.mkdir(parents=True)
    curve = [{"fraction": i / 4, "time_s": 60.0 * i, "accuracy": a, "stderr": 0.02} for i, a in enumerate(accuracies)]
    (d / "streamrl.json").write_text(json.dumps({"side": "streamrl", "curve": curve}))
    if bounds is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps({"learner/staleness_bound": b}) + "\n" for b in bounds))


def _combine(capsys, root, *args) -> tuple[int, dict | None, str]:
    """(exit status, the JSON line or None, stderr) of ``staleness_sweep.py combine ROOT --json``."""
    rc = sweep.main(["combine", str(root), "--json", *args])
    out = capsys.readouterr()
    return rc, json.loads(out.out.splitlines()[-1]) if rc == 0 else None, out.err


def test_combine_medians_best_fixed_and_adaptive_ratio(tmp_path, capsys):
    for r, final in enumerate((0.40, 0.42, 0.38)):
        _side(tmp_path, f"fixed2-r{r}", [0.1, 0.2, 0.3, 0.4, final])
    for r in range(3):
        _side(tmp_path, f"fixed8-r{r}", [0.1, 0.1, 0.2, 0.3, 0.35])
        _side(tmp_path, f"adaptive-r{r}", [0.1, 0.25, 0.35, 0.4, 0.41], bounds=[4, 3, 3, 2])
    _side(tmp_path, "notes-r0", [0.0, 1.0, 1.0, 1.0, 1.0])  # not a setting: ignored
    rc, res, err = _combine(capsys, tmp_path)
    assert rc == 0, err
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
    assert res["base_accuracy"] == pytest.approx(0.1) and res["target_above_base"]


def test_nothing_learned_gives_no_ratio(tmp_path, capsys):
    for setting in ("fixed1", "adaptive"):
        _side(tmp_path, f"{setting}-r0", [0.0] * 5)
    res = _combine(capsys, tmp_path)[1]
    assert not res["target_above_base"] and res["adaptive_vs_best_fixed"] is None


def test_overrides_and_errors(tmp_path, capsys):
    assert sweep.main(["overrides", "adaptive"]) == 0
    out = capsys.readouterr().out
    assert "learner.staleness=adaptive" in out and "learner.max_staleness=8" in out
    rc, _, err = _combine(capsys, tmp_path)
    assert rc == 2 and "no <setting>-r<repeat>/streamrl.json" in err
