"""A whole run with ZeroMQ CURVE switched on through the environment (trajectory + weights sockets)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import zmq

from streamrl.security import write_keypair


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_with_curve_keys(tmp_path, repo, python):
    keys = tmp_path / "keys"
    write_keypair(keys, "server")
    write_keypair(keys, "client")
    run_dir = tmp_path / "run"
    env = {**os.environ, "STREAMRL_CURVE_DIR": str(keys)}
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"), "--learners", "1",
         "--rollers", "1", "--steps", "6", "--run-dir", str(run_dir), "weights.data_plane=zmq"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["samples"] > 0
    # The same environment turns the learner's socket into a CURVE server (refusing plaintext
    # peers is covered on real sockets in tests/test_security.py).
    ctx = zmq.Context()
    try:
        from streamrl.security import load_curve_keys
        from tests.test_security import check_curve
        from streamrl.transport.sockets import learner_socket
        from streamrl.transport.codec import Limits

        os.environ["STREAMRL_CURVE_DIR"] = str(keys)
        sock = learner_socket(ctx, "tcp://127.0.0.1:*", 4, Limits())
        assert check_curve(sock) == "server"
        sock.close()
        assert load_curve_keys("client") is not None
    finally:
        os.environ.pop("STREAMRL_CURVE_DIR", None)
        ctx.term()
