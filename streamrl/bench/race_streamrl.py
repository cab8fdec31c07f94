"""The race's StreamRL side: ``streamrl-launch`` under a wall-clock budget, with timed exports.

The learner writes a Hugging Face folder every ``export_every`` steps
(``checkpoint.hf_interval``; ``streamrl.export.write_step_folder``), and one more when it stops
(``checkpoint.save_on_stop``). This module starts the launcher, watches those folders appear
(the time a folder is first seen is its ``time_s``, counted from the launcher's start, model
load and warm-up included), sends Ctrl-C (a clean stop request) when the budget is spent, and
keeps for each budget mark (25/50/75 %) the newest folder seen by then, plus the stop's folder
(100 %); the others are deleted as soon as a newer one makes them useless (a 135 M model's
fp32 folder is 0.5 GB).
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from streamrl.export import hf_export_dir

POLL_S = 0.25  # how often the export folder is listed
MARKS = (0.25, 0.5, 0.75, 1.0)


def _step_folders(root: Path) -> list[Path]:
    # a folder under its final name is complete: the learner writes to a temporary name first
    return sorted(d for d in root.glob("step_*") if d.is_dir()) if root.is_dir() else []


def launch_command(config: str, run_dir: Path, rollers: int, export_every: int, overrides: list[str]) -> list[str]:
    """The launcher's command line: a step count the budget never reaches, timed HF exports kept,
    no evaluator process (the race scores the exports afterwards; the peer has no evaluator either)."""
    return [sys.executable, "-m", "streamrl.launcher.launch", "--config", config, "--learners", "1",
            "--rollers", str(rollers), "--steps", "1000000", "--run-dir", str(run_dir), *overrides,
            "eval.interval=0", f"checkpoint.hf_interval={export_every}", "checkpoint.keep_last=1000000",
            "checkpoint.save_on_stop=true",
            "checkpoint.save_interval=0"]


class ExportWatcher:
    """Keeps the newest export at each budget mark; deletes exports no mark can use any more."""

    def __init__(self, root: Path, budget_s: float):
        self.root, self.budget_s = root, budget_s
        self.seen: dict[Path, float] = {}
        self.pinned: dict[float, Path] = {}

    def poll(self, elapsed: float) -> None:
        for d in _step_folders(self.root):
            self.seen.setdefault(d, elapsed)
        for mark in MARKS[:-1]:
            if mark not in self.pinned and elapsed >= mark * self.budget_s:
                before = [d for d, t in self.seen.items() if t <= mark * self.budget_s]
                if before:
                    self.pinned[mark] = max(before)
        keep = set(self.pinned.values()) | ({max(self.seen)} if self.seen else set())
        for d in list(self.seen):
            if d not in keep:
                shutil.rmtree(d, ignore_errors=True)
                del self.seen[d]


def run_streamrl_side(config: str, out: Path, budget_s: float, rollers: int, export_every: int,
                      overrides: list[str], groups_x_samples: int) -> list[dict]:
    """Train under the budget; returns ``[{"fraction", "time_s", "step", "samples", "folder"}]``.

    ``groups_x_samples``: trajectories per learner step (groups_per_step x group_size). A mark
    reached before the first export is the base model (step 0, ``time_s`` None: the caller puts
    the mark's time there).
    """
    run_dir = out / "streamrl-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_cfg = _run_cfg(config, run_dir, overrides)
    cfg_dir, base_model = hf_export_dir(run_cfg, 0).parent, run_cfg.model.path
    log = (out / "streamrl-launch.log").open("w")
    t0 = time.time()
    proc = subprocess.Popen(launch_command(config, run_dir, rollers, export_every, overrides), stdout=log,
                            stderr=subprocess.STDOUT)
    watcher = ExportWatcher(cfg_dir, budget_s)
    try:
        while proc.poll() is None and time.time() - t0 < budget_s:
            watcher.poll(time.time() - t0)
            time.sleep(POLL_S)
        stop_s = time.time() - t0
        if proc.poll() is not None:
            raise RuntimeError(f"streamrl-launch exited with {proc.returncode} before the budget "
                               f"(see {out / 'streamrl-launch.log'})")
        watcher.poll(stop_s)
        proc.send_signal(signal.SIGINT)  # a clean stop: the learner writes its stop-time folder
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    folders = _step_folders(cfg_dir)
    points = [_point(m, watcher.seen[watcher.pinned[m]], watcher.pinned[m], groups_x_samples) if m in watcher.pinned
              else _untrained(m, base_model) for m in MARKS[:-1]]
    # no folder at all: the budget ended before the first learner step (start-up took all of it)
    points.append(_point(1.0, stop_s, max(folders), groups_x_samples) if folders else _untrained(1.0, base_model))
    (out / "streamrl-exports.json").write_text(json.dumps(points, indent=2))
    return points


def _untrained(fraction: float, base_model: str) -> dict:
    """A mark reached before any export: the model is still the base model."""
    return {"fraction": fraction, "time_s": None, "step": 0, "samples": 0, "folder": base_model}


def _point(fraction: float, time_s: float, folder: Path, groups_x_samples: int) -> dict:
    step = int(folder.name.split("_")[1])
    return {"fraction": fraction, "time_s": round(time_s, 2), "step": step, "samples": step * groups_x_samples,
            "folder": str(folder)}


def _run_cfg(config: str, run_dir: Path, overrides: list[str]):
    from streamrl.config import load_config  # noqa: PLC0415

    return load_config(config, [*overrides, f"run.run_dir={run_dir}"])
