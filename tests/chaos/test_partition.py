"""A network partition between network-namespace "hosts" (the bridge of tests/test_multinode.py).

    h0  Redis + the learner (1 rank)          h1  rollout worker (cut off, then degraded)
    h2  rollout worker (keeps the run going)

h1's port on the bridge goes down for ``LINK_DOWN_S`` (a pulled cable), then the link comes back
degraded for ``DEGRADED_S``: 200 ms delay and 5 % loss each way (``tc netem``, or where the
kernel has no netem, the same through NFQUEUE and iptables: tests/chaos/slow_link.py). The run must carry on: the learner notes
h1's worker gone (heartbeat) and trains on h2's; the worker's Redis calls wait named and it comes
back once the link does. Then the run is stopped (Ctrl-C to the head) and its ledger checked.
"""
from __future__ import annotations

import contextlib
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
from .slow_link import degraded

pytestmark = [pytest.mark.chaos, pytest.mark.multinode]
LINK_DOWN_S = 20.0
DEGRADED_S = float(os.environ.get("PARTITION_DEGRADED_S", "60"))
DELAY_MS, LOSS = 200, 0.05
SHORT = ["deadlines.heartbeat_s=3"]  # the learner notes the lost worker within seconds


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def _degraded(link: list[tuple[str, str]]):
    """Both ends of a link ((namespace, device) pairs) delay DELAY_MS and drop LOSS of packets
    within the block; yields what was applied."""
    netem = ["netem", "delay", f"{DELAY_MS}ms", "loss", f"{LOSS:.0%}"]
    if _tc(link[0][0], "qdisc", "replace", "dev", link[0][1], "root", *netem).returncode != 0:
        # no sch_netem in this kernel: hold and drop h1's packets in both directions instead
        with degraded(link[1][0], link[1][1], DELAY_MS, LOSS) as what:
            yield what
        return
    try:
        _tc(link[1][0], "qdisc", "replace", "dev", link[1][1], "root", *netem)
        yield f"netem delay {DELAY_MS}ms loss {LOSS:.0%} each way"
    finally:
        for ns, dev in link:
            _tc(ns, "qdisc", "del", "dev", dev, "root")


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
        with _degraded(link) as how:
            ip("-n", switch, "link", "set", "p1", "up")
            t_up = time.monotonic()
            wait_for(lambda: f"worker {cut} is back" in _text(learner_log), 60, f"worker {cut} back after the link")
            recovered = time.monotonic() - t0
            _hold(DEGRADED_S - (time.monotonic() - t_up), _steps(tmp_path), tmp_path, "the degraded link")
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
    fault_line("network partition (h1: link down 20 s, then degraded)", detected, recovered, s, degraded=how,
               degraded_s=DEGRADED_S, steps=s["steps"])


ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], 5599))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while d := c.recv(65536):
        c.sendall(d)
"""
PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 5599), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[2])):
    t = time.monotonic()
    c.sendall(b"x" * 64)
    got = 0
    while got < 64:
        got += len(c.recv(64))
    rtts.append(time.monotonic() - t)
print(statistics.median(rtts) * 1000)
"""


@pytest.mark.timeout(120)
def test_degraded_link_delays_each_way(hosts, python):  # noqa: F811
    """The degraded phase is what it says: a round trip between h0 and h1 takes 2 x DELAY_MS
    (median of 10 small echoes over TCP, which retransmits what the loss drops); < 50 ms before."""
    switch = hosts[0][0].rsplit("h", 1)[0] + "sw"
    server = subprocess.Popen(["ip", "netns", "exec", hosts[0][0], python, "-c", ECHO, hosts[0][1]],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"

        def rtt_ms(n: int) -> float:
            out = subprocess.run(["ip", "netns", "exec", hosts[1][0], python, "-c", PING, hosts[0][1], str(n)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return float(out.stdout)

        healthy_ms = rtt_ms(10)
        with _degraded([(switch, "p1"), (hosts[1][0], hosts[1][2])]):
            degraded_ms = rtt_ms(10)
    finally:
        server.kill()
        server.wait()
    assert healthy_ms < 50, healthy_ms
    assert 2 * DELAY_MS <= degraded_ms < 2 * DELAY_MS + 150, (healthy_ms, degraded_ms)
