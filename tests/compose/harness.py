"""Docker for the compose tier: install what is missing, start a daemon the tier owns, build the
image offline (docker/build-local.sh), run compose projects and make sure nothing outlives them.

The daemon runs with ``--iptables=false --bridge=none`` so the host's firewall and interfaces are
left as they are; the services use the host network and loopback addresses only. A daemon that
was already running is used and left running; one this module started is stopped at the end.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APT_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap", "docker-compose": "docker-compose"}
PROJECT_LABEL = "com.docker.compose.project"


def run(cmd: list[str], timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_missing() -> str | None:
    """apt-get install the tools that are missing; returns why Docker cannot run here, or None."""
    if os.geteuid() != 0:
        return "the compose tier needs root (dockerd, debootstrap)"
    missing = sorted({pkg for tool, pkg in APT_PACKAGES.items() if shutil.which(tool) is None})
    if missing and shutil.which("apt-get") is None:
        return f"missing {', '.join(missing)} and no apt-get to install them"
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            if r.returncode != 0:
                return f"apt-get install {' '.join(missing)} failed: {r.stderr.strip().splitlines()[-1:]}"
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    return None


class Daemon:
    """The Docker daemon: the running one, or one started here (and stopped by :meth:`stop`)."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def answers() -> bool:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0

    def start(self) -> str | None:
        """Returns why no daemon could be had, or None."""
        if self.answers():
            return None
        log = (self.log_dir / "dockerd.log").open("wb")
        self.proc = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none"], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.answers():
                return None
            time.sleep(0.5)
        tail = (self.log_dir / "dockerd.log").read_text(errors="replace").strip().splitlines()[-1:]
        self.stop()
        return f"dockerd did not start: {tail}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # dockerd stops its containerd and containers itself
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def build_image(image: str) -> None:
    """docker/build-local.sh: the debootstrap base, the wheelhouse and ``image`` (cached)."""
    env = {**os.environ, "STREAMRL_IMAGE": image, "PIP": f"{sys.executable} -m pip"}
    run([str(REPO / "docker" / "build-local.sh")], timeout=1800, env=env)


def compose_cli() -> list[str]:
    """``docker compose`` (v2 plugin) where the client has it, else Debian's ``docker-compose``."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


class Project:
    """One compose project (``-p name``) over ``files`` with ``env`` as its variables."""

    def __init__(self, name: str, files: list[Path], env: dict[str, str], profiles: tuple[str, ...] = ()):
        self.name, self.env = name, {"PATH": os.environ["PATH"], **env}
        self.base = [*compose_cli(), "-p", name, *[a for f in files for a in ("-f", str(f))],
                     *[a for p in profiles for a in ("--profile", p)]]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.base, *args], timeout=timeout, check=check, env=self.env)

    def ids(self, service: str, running_only: bool = True) -> list[str]:
        flt = ["--filter", f"label={PROJECT_LABEL}={self.name}",
               "--filter", f"label=com.docker.compose.service={service}"]
        return run(["docker", "ps", "-q", *([] if running_only else ["-a"]), *flt]).stdout.split()

    def exit_code(self, container: str) -> int | None:
        """The container's exit code once it stopped, else None."""
        out = run(["docker", "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", container]).stdout.split()
        return None if out[0] == "true" else int(out[1])

    def logs(self) -> str:
        """The services' last lines, each cut to 300 characters (the monitor prints long JSON)."""
        r = self("logs", "--no-color", "--tail", "30", check=False, timeout=60)
        return "\n".join(line[:300] for line in (r.stdout + r.stderr).splitlines())

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "--timeout", "20", check=False, timeout=180)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        flt = ["--filter", f"label={PROJECT_LABEL}={self.name}"]
        out = {"containers": run(["docker", "ps", "-aq", *flt]).stdout.split(),
               "networks": run(["docker", "network", "ls", "-q", *flt]).stdout.split(),
               "volumes": run(["docker", "volume", "ls", "-q", *flt]).stdout.split()}
        return {k: v for k, v in out.items() if v}
