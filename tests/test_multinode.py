"""Three hosts on one machine: Linux network namespaces joined by a bridge, each with its own address.

    h0 10.213.0.1   Redis (embedded, password) + learner (2 ranks), started with --role learner
    h1 10.213.0.2   2 rollout workers, --role rollout --node-rank 1
    h2 10.213.0.3   2 rollout workers, --role rollout --node-rank 2

The bridge lives in a fourth namespace, so the machine's own network is never touched and
traffic only flows between the addresses created here. Workers find the learner's
trajectory endpoint through Redis. (Weights still travel through /dev/shm, which network
namespaces share; across real machines that is the cross-host weights data plane's job.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid

import pytest

pytestmark = pytest.mark.multinode

SUBNET = "10.213.0"
PASSWORD = "mn-" + uuid.uuid4().hex[:12]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"srlprobe{os.getpid()}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' is not permitted here: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def hosts():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"srl{os.getpid() % 100000}"
    switch, names = f"{tag}sw", [f"{tag}h{i}" for i in range(3)]
    created = []
    try:
        for ns in [switch, *names]:
            ip("netns", "add", ns)
            created.append(ns)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, ns in enumerate(names):
            ip("link", "add", f"v{i}", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", switch)
            ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
            ip("-n", switch, "link", "set", f"p{i}", "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"v{i}")
            ip("-n", ns, "link", "set", f"v{i}", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        r = subprocess.run(["ip", "netns", "exec", names[1], "ping", "-c", "1", "-W", "2", f"{SUBNET}.1"],
                           capture_output=True, text=True, timeout=30)
        if shutil.which("ping") and r.returncode != 0:
            pytest.fail(f"namespaces are not connected: {r.stdout} {r.stderr}")
        yield [(ns, f"{SUBNET}.{i + 1}", f"v{i}") for i, ns in enumerate(names)]
    finally:
        for ns in created:
            ip("netns", "del", ns, check=False)


@pytest.mark.timeout(600)
def test_three_hosts_learner_and_two_rollout_hosts(hosts, tmp_path, repo, python):
    run_id = f"mn-{uuid.uuid4().hex[:8]}"
    head_addr = hosts[0][1]
    redis_port, master_port, steps = 6391, 29531, 40
    common = [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"),
              "--nnodes", "3", "--run-id", run_id, "--master-addr", head_addr, "--master-port", str(master_port)]
    cmds = [
        common + ["--node-rank", "0", "--role", "learner", "--learners", "2", "--steps", str(steps),
                  "--redis-host", head_addr, "--redis-port", str(redis_port), "--redis-password", PASSWORD,
                  "--run-dir", str(tmp_path / "h0")],
    ]
    url = f"redis://:{PASSWORD}@{head_addr}:{redis_port}/0"
    for rank in (1, 2):
        cmds.append(common + ["--node-rank", str(rank), "--role", "rollout", "--rollers", "2", "--redis-url", url,
                              "--run-dir", str(tmp_path / f"h{rank}"), "--wait-timeout", "240"])
    procs = []
    try:
        # Rollout hosts first: they must wait for the head's run to appear in Redis.
        for (ns, _, ifname), cmd in reversed(list(zip(hosts, cmds))):
            # gloo picks its interface from the hostname, which resolves outside the namespace.
            env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname}
            procs.insert(0, subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=repo, env=env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                             start_new_session=True))
            time.sleep(1.0 if ns != hosts[0][0] else 0)
        outs = []
        deadline = time.monotonic() + 540
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    report = "\n".join(f"--- host {i} (rc {p.returncode})\n{o}" for i, (p, o) in enumerate(zip(procs, outs)))
    assert [p.returncode for p in procs] == [0, 0, 0], report
    summary = json.loads((tmp_path / "h0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps, summary
    assert summary["reward_last"] > summary["reward_first"] + 0.05, summary  # it trains
    # Worker ids came from the shared counter: 0-3, two per rollout host, each connected to h0's address.
    ids = {}
    for rank in (1, 2):
        logs = sorted((tmp_path / f"h{rank}" / "logs").glob("rollout-*.log"))
        assert len(logs) == 2, report
        for log in logs:
            text = log.read_text()
            m = re.search(r"connected to tcp://([\d.]+):\d+", text)
            assert m and m.group(1) == head_addr, text[-2000:]
            ids[int(log.stem.split("-")[1])] = rank
    assert sorted(ids) == [0, 1, 2, 3], ids
    assert "learner-node" not in " ".join(os.listdir(tmp_path / "h0" / "logs"))
    print(report)
