"""Supervised child processes: own session, per-process log file, bounded restarts with backoff."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

# Children (and torchrun's ranks, which read DIE_WITH_PARENT_ENV) ask the kernel for a signal
# when their parent dies, so a SIGKILLed launcher or torchrun agent leaves no orphans holding
# ports and devices.
from streamrl.utils import DIE_WITH_PARENT_ENV, die_with_parent_preexec


@dataclass
class ManagedProcess:
    """One child process (its whole process group is signalled, so torchrun's ranks go too)."""

    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    backoff_s: float = 1.0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    _restart_at: float | None = None
    makes_batches: bool = True
    """A rollout worker. False for helpers (evaluator, role servers): the run fails when every
    batch maker has failed, whatever the helpers do."""
    parked_since: float | None = None
    """Set while the process exited because the run stopped; it restarts only if the run goes on."""

    def start(self) -> None:
        self.parked_since = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {self.name} (restart {self.restarts}): {' '.join(self.cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, DIE_WITH_PARENT_ENV: "1", **self.env},
                                     start_new_session=True, preexec_fn=die_with_parent_preexec())
        log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        """Exit code if the current incarnation has exited, else None."""
        if self.proc is None:
            return None
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def schedule_restart(self) -> bool:
        """Record the exit; schedule a restart with exponential backoff if any are left."""
        self.exit_codes.append(self.proc.returncode)
        if self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        self._restart_at = time.monotonic() + self.backoff_s * 2 ** (self.restarts - 1)
        self.proc = None
        return True

    def restart_due(self) -> bool:
        if self._restart_at is not None and time.monotonic() >= self._restart_at:
            self._restart_at = None
            return True
        return False

    @property
    def restarting(self) -> bool:
        return self._restart_at is not None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL. Returns the exit code."""
        self._restart_at = None
        if self.proc is None:
            return None
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        try:  # stragglers in the group (e.g. torchrun's ranks)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode
