"""The monitor, the report and the metrics overhead on a real run.

streamrl-launch (tiny config, 2 learner ranks, 2 rollout workers) against the session's real
redis-server; while it trains, ``streamrl-monitor --once --json`` (a subprocess) must report
rates that agree with the run's own metrics.jsonl over the same learner steps, the live UI
must show every section, and afterwards the report and the overhead replay must hold.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from rich.console import Console

from streamrl.monitor.cli import take_snapshot
from streamrl.monitor.overhead import measure
from streamrl.monitor.report import PLOTS, build_report
from streamrl.monitor.snapshot import SnapshotBuilder
from streamrl.monitor.source import RunSource
from streamrl.monitor.ui import render

SECTIONS = ("Totals", "History", "Staleness", "Weights", "MoE router", "Workers")
# long enough to still be running while two monitor processes start (imports take seconds each)
STEPS = 200


def _wait(pred, timeout_s, what, proc):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        assert proc.poll() is None, f"streamrl-launch exited with {proc.returncode} before {what}"
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _learner_step(url, run_id):
    try:
        src = RunSource(url, run_id)
        return int(src.refresh().latest.get("learner", {}).get("learner/step", 0))
    except Exception:
        return 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_monitor_report_overhead_on_real_run(tmp_path, repo, python, redis_url):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "launch.log", "wb")
    proc = subprocess.Popen(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"), "--learners", "2",
         "--rollers", "2", "--steps", str(STEPS), "--run-dir", str(run_dir), "--redis-url", redis_url],
        cwd=repo, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        meta = _wait(lambda: (run_dir / "run.json").is_file() and json.loads((run_dir / "run.json").read_text()),
                     240, "run.json", proc)
        run_id = meta["run_id"]
        _wait(lambda: _learner_step(redis_url, run_id) >= 30, 400, "learner step 30", proc)
        # the UI snapshot first, while the workers surely beat: the two monitor processes below
        # take their imports' time, and on a loaded machine the run can end meanwhile
        snap_ui = take_snapshot(RunSource(redis_url, run_id), SnapshotBuilder(window_s=20))
        live = subprocess.run([python, "-m", "streamrl.monitor.cli", str(run_dir), "--iterations", "2",
                               "--interval", "0.5"], capture_output=True, text=True, timeout=120)
        once = subprocess.run([python, "-m", "streamrl.monitor.cli", str(run_dir), "--once", "--json",
                               "--window", "20"], capture_output=True, text=True, timeout=120)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()
    assert proc.returncode == 0, (tmp_path / "launch.log").read_text()[-3000:]

    # -- the live UI (subprocess loop) and its recorded screen ----------------------------------
    assert live.returncode == 0, live.stderr
    console = Console(record=True, width=130, color_system=None)
    console.print(render(snap_ui, redis_url))
    screen = console.export_text()
    (run_dir / "monitor_screen.txt").write_text(screen)
    for section in SECTIONS:
        assert section in screen and section in live.stdout, section
    assert [w["status"] for w in snap_ui["workers"]] == ["alive", "alive"], snap_ui["workers"]
    assert snap_ui["moe"]["layers"] and snap_ui["staleness"]["histogram_source"] == "learner"

    # -- --once --json against the run's own metrics.jsonl, same learner steps ------------------
    assert once.returncode == 0, once.stderr
    snap = json.loads(once.stdout)
    assert snap["run_id"] == run_id and snap["status"] == "running"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    s0, s1 = snap["window"]["learner_steps"]
    assert s1 - s0 >= 3, snap["window"]
    a, b = rows[int(s0) - 1], rows[int(s1) - 1]
    dt = b["time"] - a["time"]
    want = {
        "trained_trajectories_per_s": (b["learner/samples"] - a["learner/samples"]) / dt,
        "trained_tokens_per_s": sum(r["learner/trained_tokens"] for r in rows[int(s0):int(s1)]) / dt,
    }
    got = snap["totals"]
    for key, expected in want.items():
        assert got[key] == pytest.approx(expected, rel=0.2), (key, got[key], expected)
    # consistency, not identity: workers' generated trajectories vs what the learner received,
    # over windows that differ by up to a flush interval, in bursts of 64 trajectories per batch
    received = (b["transport/trajectories"] - a["transport/trajectories"]) / dt
    (run_dir / "rates_check.json").write_text(json.dumps(
        {"steps": [s0, s1], "monitor": {k: got[k] for k in want} | {"trajectories_per_s": got["trajectories_per_s"]},
         "metrics_jsonl": want | {"received_trajectories_per_s": received}}, indent=1))
    assert got["trajectories_per_s"] == pytest.approx(received, rel=0.3), (got["trajectories_per_s"], received)
    assert got["generated_tokens_per_s"] > got["trajectories_per_s"] > 0
    assert 0 <= got["learner_idle_frac"] <= 1 and got["version"] >= s1

    # the run ended: Redis still has it, the monitor says so
    after = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", redis_url, "--run-id", run_id,
                            "--once", "--json"], capture_output=True, text=True, timeout=120)
    assert after.returncode == 0 and json.loads(after.stdout)["status"].startswith("ended")

    # -- report: PNGs and the data behind them ----------------------------------------------------
    rep = build_report(run_dir)
    for name in PLOTS:
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 10_000, name
        assert rep["data"][name] and all(len(xs) > 0 for xs, _ in rep["data"][name].values()), name
    assert rep["data"]["reward"]["reward vs samples"][1] == [r["learner/reward_mean"] for r in rows]
    assert len(rep["data"]["staleness"]["lag histogram"][0]) >= 1

    # -- overhead: the run's own dicts through the real sinks, vs that run's step time ------------
    ovh = measure(rows, redis_url, tmp_path / "overhead")
    (run_dir / "overhead.json").write_text(json.dumps(ovh))
    assert ovh["hot_path_frac"] < 0.01 and ovh["cpu_frac"] < 0.01, ovh
