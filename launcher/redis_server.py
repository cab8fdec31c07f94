"""An embedded ``redis-server`` on a free loopback port, owned by the launcher or a test.

It also listens on a Unix socket in its workdir (``unix_url``), which same-host processes
use: a command's round trip over the socket skips the TCP loopback stack, which is most of
a small weights version's announcement. Other hosts (and containers) use the TCP ``url``.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from streamrl.utils import die_with_parent_preexec


# sun_path holds 108 bytes with its terminating NUL (Linux): a longer socket path cannot be bound.
SUN_PATH_MAX = 107
SOCKET_NAME = "redis.sock"


def unix_socket_path(workdir: str | Path) -> Path | None:
    """``WORKDIR/redis.sock`` (absolute), or None when that path is too long for a socket address."""
    path = Path(workdir).resolve() / SOCKET_NAME
    return path if len(os.fsencode(path)) <= SUN_PATH_MAX else None


def unix_url(path: str | Path, password: str | None = None) -> str:
    """``unix://[:PASSWORD@]/PATH?db=0``: redis-py's URL of a Unix socket."""
    auth = f":{password}@" if password else ""
    return f"unix://{auth}{quote(str(path))}?db=0"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """Start ``redis-server`` bound to loopback (no persistence); ``url`` once started.

    Loopback only: an embedded Redis without a password must never listen on a
    reachable address. ``unix_socket``: also listen on ``WORKDIR/redis.sock`` (mode 700:
    only this user), unless that path is longer than a socket address holds; then
    ``unix_url`` is None and ``local_url`` is the TCP ``url``. A restart (``stop`` then
    ``start``) re-creates the socket at the same path, as it reuses the port.
    """

    def __init__(self, workdir: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 password: str | None = None, unix_socket: bool = True):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found on PATH; run `make setup` (it installs Debian's redis-server)")
        if host not in ("127.0.0.1", "localhost", "::1") and not password:
            raise ValueError(f"refusing to bind Redis to non-loopback address {host!r} without a password")
        self.host, self.port, self.password = host, port or free_port(host), password
        self.workdir = Path(workdir)
        self.socket_path = unix_socket_path(self.workdir) if unix_socket else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def unix_url(self) -> str | None:
        """``unix://[:PASSWORD@]/WORKDIR/redis.sock?db=0``, or None without a socket."""
        return None if self.socket_path is None else unix_url(self.socket_path, self.password)

    @property
    def local_url(self) -> str:
        """The URL for processes on this host: the Unix socket's when there is one, else ``url``."""
        return self.unix_url or self.url

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--protected-mode", "yes" if not self.password else "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.socket_path is not None:
            # redis-server removes a stale socket file (a SIGKILLed earlier incarnation) before binding
            cmd += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        log = open(self.workdir / "redis.log", "ab")
        # dies with the launcher: a SIGKILLed head must not leave the embedded server running
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent_preexec())
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.local_url, socket_connect_timeout=0.5)
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
