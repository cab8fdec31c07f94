"""Launch configs/tiny.yaml (with overrides) as real processes through streamrl-launch."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml


def launch_tiny(tmp_path: Path, repo: Path, python: str, steps: int, learners: int = 1, rollers: int = 1,
                **sections: dict) -> tuple[dict, dict]:
    """Run the tiny config for ``steps`` steps with each ``sections[name]`` merged into that config
    section (e.g. ``rollout={"engine": "hf_fast"}``); asserts the launcher exited 0.

    Returns ``(config, summary)``: the config as run and the run's ``summary.json``; the run directory
    is ``tmp_path / "run"`` (:func:`run_metrics` reads its ``metrics.jsonl``).
    """
    cfg = yaml.safe_load((repo / "configs/tiny.yaml").read_text())
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(tmp_path / "run.yaml"),
         "--learners", str(learners), "--rollers", str(rollers), "--steps", str(steps), "--run-dir", str(run_dir)],
        cwd=repo, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cfg, json.loads((run_dir / "summary.json").read_text())


def run_metrics(tmp_path: Path) -> list[dict]:
    """The learner's ``metrics.jsonl`` of the :func:`launch_tiny` run in ``tmp_path``: one dict per step."""
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
