"""streamrl-monitor shows multi-turn tool runs: turns per episode, tool-call rate,
tool calls, errors, timeouts and latency, from the ``env/...`` metrics rollout workers write."""
from __future__ import annotations

import json
import subprocess

import pytest
from rich.console import Console

from streamrl.coord.coordinator import Coordinator
from monitor_helpers import empty_state
from streamrl.monitor.snapshot import SnapshotBuilder
from streamrl.monitor.ui import render

# What two workers' EpisodeBatchRoller reports after a batch (streamrl.envs.episode_metrics + runner counters).
WORKER_ENV = [
    {"env/turns_mean": 2.0, "env/tool_call_rate": 1.0, "env/tool_calls": 64.0, "env/tool_errors": 2.0,
     "env/tool_latency_s": 0.004, "env/reward_mean": 0.5, "env/tool_calls_total": 640.0,
     "env/tool_errors_total": 5.0, "env/tool_timeouts_total": 1.0, "env/tools_hung": 0.0,
     "env/prefill_tokens": 300.0, "env/prefill_tokens_saved": 500.0},
    {"env/turns_mean": 1.5, "env/tool_call_rate": 0.5, "env/tool_calls": 32.0, "env/tool_errors": 0.0,
     "env/tool_latency_s": 0.002, "env/reward_mean": 0.25, "env/tool_calls_total": 320.0,
     "env/tool_errors_total": 0.0, "env/tool_timeouts_total": 0.0, "env/tools_hung": 1.0,
     "env/prefill_tokens": 100.0, "env/prefill_tokens_saved": 100.0},
]


def _text(snap, width=130) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(render(snap, "redis://x"))
    return console.export_text()


def test_env_panel_rows_from_worker_metrics(redis_url, run_id, python):
    coord = Coordinator(redis_url, run_id)
    coord.put_config({"run": {"name": "tools"}})
    coord.put_metrics("learner", {"learner/step": 3, "learner/samples": 192, "learner/reward_mean": 0.4})
    for w, m in enumerate(WORKER_ENV):
        coord.put_metrics(f"rollout-{w}", {"rollout/generated_tokens": 500, "rollout/trajectories": 64, **m})
    p = subprocess.run([python, "-m", "streamrl.monitor.cli", "--redis-url", redis_url, "--run-id", run_id,
                        "--once", "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    env = json.loads(p.stdout)["env"]
    assert env["turns_mean"] == pytest.approx(1.75) and env["tool_call_rate"] == pytest.approx(0.75)
    assert (env["tool_calls"], env["tool_errors"], env["tool_calls_total"]) == (96.0, 2.0, 960.0)
    assert (env["tool_errors_total"], env["tool_timeouts_total"], env["tools_hung"]) == (5.0, 1.0, 1.0)
    assert env["tool_latency_s"] == pytest.approx(0.003)
    assert (env["prefill_tokens"], env["prefill_tokens_saved"]) == (400.0, 600.0)

    state = empty_state(100.0)
    state.latest = {f"rollout-{w}": m for w, m in enumerate(WORKER_ENV)}
    snap = SnapshotBuilder().build("r", {f"rollout-{w}": [{"time": 99.0, **m}] for w, m in enumerate(WORKER_ENV)},
                                   state)
    for width in (130, 80):
        text = _text(snap, width)
        assert "tool-call rate" in text and "75 %" in text and "turns / episode" in text
        assert "5 / 1 / 1 errors" in text and "3.0 ms" in text
        assert "prompt KV reused" in text and "60 %" in text


def test_single_turn_runs_show_no_env_rows():
    state = empty_state(100.0)
    state.latest = {"rollout-0": {"rollout/generated_tokens": 10.0}}
    snap = SnapshotBuilder().build("r", {"rollout-0": [{"time": 99.0, "rollout/generated_tokens": 10.0}]}, state)
    assert "env" not in snap and "tool-call rate" not in _text(snap)
