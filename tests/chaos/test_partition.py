"""A network partition between network-namespace "hosts" (the bridge of tests/test_multinode.py).

    h0  Redis + the learner (1 rank)          h1  rollout worker (cut off, then degraded)
    h2  rollout worker (keeps the run going)

h1's port on the bridge goes down for ``LINK_DOWN_S`` (a pulled cable), then the link comes back
degraded for ``DEGRADED_S``: 200 ms delay and 5 % loss each way (``tc netem``), or where the
kernel has no netem, a 256 kbit/s ``tbf`` bottleneck. The run must carry on: the learner notes
h1's worker gone (heartbeat) and trains on h2's; the worker's Redis calls wait named and it comes
back once the link does. Then the run is stopped (Ctrl-C to the head) and its ledger checked.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.test_multinode import hosts, ip  # noqa: F401  (hosts: the namespaces fixture)

from .conftest import FAST, check_ledger, fault_line, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.multinode]
LINK_DOWN_S = 20.0
# 30 s rather than a minute: the chaos tier runs on 2 cores in CI, and 30 s is ~100 learner steps
DEGRADED_S = float(os.environ.get("PARTITION_DEGRADED_S", "30"))
SHORT = ["deadlines.heartbeat_s=3"]  # the learner notes the lost worker within seconds


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)


def _degrade(link: list[tuple[str, str]]) -> str:
    """Degrade both ends of a link ((namespace, device) pairs); returns what was applied."""
    netem = ["netem", "delay", "200ms", "loss", "5%"]
    if _tc(link[0][0], "qdisc", "replace", "dev", link[0][1], "root", *netem).returncode == 0:
        _tc(link[1][0], "qdisc", "replace", "dev", link[1][1], "root", *netem)
        return "netem delay 200ms loss 5%"
    tbf = ["tbf", "rate", "256kbit", "burst", "16kb", "latency", "400ms"]  # this kernel has no sch_netem
    for ns, dev in link:
        r = _tc(ns, "qdisc", "replace", "dev", dev, "root", *tbf)
        assert r.returncode == 0, r.stderr
    return "tbf rate 256kbit (no netem in this kernel)"


def _start(nodes, tmp_path: Path, repo: Path, python: str) -> list[subprocess.Popen]:
    """One launcher per namespace, rollout hosts first (they wait for the head's run in Redis)."""
    run_id, password = f"part-{uuid.uuid4().hex[:8]}", "pt-" + uuid.uuid4().hex[:12]
    head = nodes[0][1]
    common = [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"), "--nnodes", "3",
              "--run-id", run_id, "--master-addr", head, "--master-port", "29541"]
    url = f"redis://:{password}@{head}:6393/0"
    cmds = [common + ["--node-rank", "0", "--role", "learner", "--learners", "1", "--steps", "100000",
                      "--redis-host", head, "--redis-port", "6393", "--redis-password", password]]
    cmds += [common + ["--node-rank", str(r), "--role", "rollout", "--rollers", "1", "--redis-url", url,
                       "--wait-timeout", "240"] for r in (1, 2)]
    procs = []
    for i in (2, 1, 0):
        ns, _, ifname = nodes[i]
        cmd = [*cmds[i], "--run-dir", str(tmp_path / f"h{i}"), *FAST, *SHORT]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "PYTHONUNBUFFERED": "1"}
        procs.insert(0, subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=repo, env=env,
                                         stdout=(tmp_path / f"launch-h{i}.log").open("wb"),
                                         stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _steps(tmp_path: Path) -> int:
    return len(_text(tmp_path / "h0" / "metrics.jsonl").splitlines())


def _worker_on(tmp_path: Path, host: int) -> int | None:
    """The id of the worker the launcher of ``host`` started (from its log's name)."""
    logs = sorted((tmp_path / f"h{host}" / "logs").glob("rollout-*.log"))
    return int(logs[0].stem.split("-")[1]) if logs and "connected to" in _text(logs[0]) else None


def _hold(seconds: float, steps_from: int, tmp_path: Path, what: str) -> None:
    """Keep the fault on for ``seconds`` (its duration, not a wait for state), requiring the
    learner to train at least 5 more steps meanwhile."""
    end = time.monotonic() + seconds
    wait_for(lambda: _steps(tmp_path) >= steps_from + 5, seconds, f"5 learner steps during {what}")
    time.sleep(max(0.0, end - time.monotonic()))


@pytest.mark.timeout(600)
def test_partition_link_down_20s_then_degraded_the_run_carries_on(hosts, tmp_path, repo, python):  # noqa: F811
    """Deadline 600 s. h1 cut off for 20 s, then degraded for DEGRADED_S: its worker is noted gone
    within deadlines.heartbeat_s (3 s) and back within deadlines.redis_outage_s (60 s) of the
    link coming up; h2's worker keeps the learner training throughout; the ledger balances."""
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed: no way to degrade the link")
    switch = hosts[0][0].rsplit("h", 1)[0] + "sw"  # the bridge's namespace (tests/test_multinode.py)
    link = [(switch, "p1"), (hosts[1][0], hosts[1][2])]  # h1's bridge port and its own end
    procs = _start(hosts, tmp_path, repo, python)
    learner_log = tmp_path / "h0" / "logs" / "learner.log"
    try:
        wait_for(lambda: _steps(tmp_path) >= 3 and None not in (_worker_on(tmp_path, 1), _worker_on(tmp_path, 2)),
                 300, "3 learner steps with both rollout hosts connected")
        cut = _worker_on(tmp_path, 1)
        assert all(p.poll() is None for p in procs), "a launcher exited before the fault"
        t0 = time.monotonic()
        ip("-n", switch, "link", "set", "p1", "down")
        wait_for(lambda: f"worker {cut} left" in _text(learner_log), LINK_DOWN_S,
                 f"the learner noting worker {cut} gone")
        detected = time.monotonic() - t0
        _hold(LINK_DOWN_S - detected, _steps(tmp_path), tmp_path, "the link-down")
        ip("-n", switch, "link", "set", "p1", "up")
        degraded = _degrade(link)
        t_up = time.monotonic()
        wait_for(lambda: f"worker {cut} is back" in _text(learner_log), 60, f"worker {cut} back after the link")
        recovered = time.monotonic() - t0
        _hold(DEGRADED_S - (time.monotonic() - t_up), _steps(tmp_path), tmp_path, "the degraded link")
        for ns, dev in link:
            _tc(ns, "qdisc", "del", "dev", dev, "root")
        healed = _steps(tmp_path)
        wait_for(lambda: _steps(tmp_path) >= healed + 5, 60, "5 learner steps after the link healed")
        procs[0].send_signal(signal.SIGINT)  # Ctrl-C to the head: a clean stop after a checkpoint
        codes = [p.wait(180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = {i: _text(tmp_path / f"launch-h{i}.log")[-2000:] for i in range(3)}
    assert codes == [130, 0, 0], logs
    s = json.loads((tmp_path / "h0" / "summary.json").read_text())
    check_ledger(s)
    assert s["status"].startswith("stopped") and s["accounting"]["workers_left"] >= 1, s["status"]
    fault_line("network partition (h1: link down 20 s, then degraded)", detected, recovered, s, degraded=degraded,
               degraded_s=DEGRADED_S, steps=s["steps"])
