"""An embedded ``redis-server`` on a free loopback port, owned by the launcher or a test."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from streamrl.utils import die_with_parent_preexec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """Start ``redis-server`` bound to loopback (no persistence); ``url`` once started.

    Loopback only: an embedded Redis without a password must never listen on a
    reachable address.
    """

    def __init__(self, workdir: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 password: str | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found on PATH; run `make setup` (it installs Debian's redis-server)")
        if host not in ("127.0.0.1", "localhost", "::1") and not password:
            raise ValueError(f"refusing to bind Redis to non-loopback address {host!r} without a password")
        self.host, self.port, self.password = host, port or free_port(host), password
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--protected-mode", "yes" if not self.password else "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        log = open(self.workdir / "redis.log", "ab")
        # dies with the launcher: a SIGKILLed head must not leave the embedded server running
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent_preexec())
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir / 'redis.log'}")
            try:
                client.ping()
                client.close()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
