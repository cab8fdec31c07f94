"""Supervision of one host's processes: restarts, learner failure, orderly shutdown, exit summary.

Rules (one loop, 5 ticks a second):

* a rollout worker that dies is restarted up to ``max_restarts`` with exponential backoff;
  one that exits because the run stopped is *parked*, and restarted only if the run goes on
  (the head restarted the learner: the run's ``epoch`` advanced);
* a rollout worker that is alive but stuck (:mod:`streamrl.launcher.watchdog`: its heartbeat
  stopped, or one batch outlasts ``deadlines.batch_s``) is reported and killed, then restarted
  as a failed one; every abnormal exit or stall is recorded for the diagnosis of a failed run;
* the learner finishing ends the run; a learner failure ends it too, unless
  ``learner_restarts`` are left: then the learner starts again with ``--resume`` while the
  workers keep running (they restart only if the learner cannot re-bind its trajectory port);
* Ctrl-C / SIGTERM: a stop on request, not a failure. The head asks the learner to stop
  through Redis (it finishes its step, checkpoints when ``checkpoint.save_on_stop`` and writes
  summary.json), then SIGTERMs it and only then kills; workers are stopped after the learner;
  the head marks the run done and gives other hosts a moment to notice before an embedded
  Redis goes away. The launcher then says where the checkpoint is and exits 128 + signal.
"""
from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from streamrl.launcher.diagnosis import Fault
from streamrl.launcher.process import ManagedProcess
from streamrl.launcher.progress import Progress
from streamrl.launcher.runstate import RunState
from streamrl.launcher.watchdog import Watchdog

TICK_S = 0.2
ENDPOINT_WATCH_S = 600.0
"""How long after a learner restart the head watches for the learner moving its trajectory endpoint."""


@dataclass
class Supervisor:
    state: RunState
    learner: ManagedProcess | None
    rollers: list[ManagedProcess]
    head: bool
    host: str
    learner_restarts: int = 0
    learner_restart_cmd: list[str] | None = None
    """The learner's command for a restart after a failure (``--resume``: it continues from the checkpoint)."""
    single_host: bool = True
    stop_grace_s: float = 30.0
    park_timeout_s: float = 300.0
    progress: Progress | None = None
    """The live progress line (head host only)."""
    watchdog: Watchdog | None = None
    """Stuck detection for the rollout workers (restarts the ones whose progress stopped)."""
    failures: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    """Every abnormal exit or stall, in the order seen (the diagnosis names the first)."""
    interrupted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.coord = self.state.coord
        self.epoch = self.state.epoch()
        self.seen_stop = False
        self._watch_endpoint_until: float | None = None
        self._old_endpoint: str | None = None
        self._config = self.coord.get_config() if self.head else None

    def on_signal(self, signum, frame) -> None:
        self.interrupted.append(signum)

    def _fault(self, p: ManagedProcess, what: str) -> None:
        self.faults.append(Fault(time.time(), p.name, what, p.log_path))

    def say(self, msg: str) -> None:
        print(f"streamrl-launch: {msg}", flush=True)

    # -- main loop -----------------------------------------------------------------------------
    def run(self) -> list[str]:
        if self.learner:
            self.learner.start()
        for r in self.rollers:
            r.start()
        try:
            while not self._tick():
                if self.progress is not None:
                    self.progress.poll()
                time.sleep(TICK_S)
        finally:
            self.shutdown()
            if self.progress is not None:
                self.progress.finish()
        return self.failures

    @property
    def stop_signal(self) -> int | None:
        """The signal that asked this host to stop (Ctrl-C: SIGINT), or None."""
        return self.interrupted[0] if self.interrupted else None

    def _tick(self) -> bool:
        """One supervision step; True when this host is finished."""
        if self.interrupted:
            return True  # a stop on request: shutdown() tells the learner why
        if self._learner_ended():
            return True
        try:
            stop = self.coord.stop_reason()
            if self._follow_run():
                return True
            if self.watchdog is not None and stop is None:
                for p, why in self.watchdog.check(self.rollers):
                    self._fault(p, why)
        except redis.RedisError as e:
            if self.seen_stop:
                return True  # the head's Redis went away after the run stopped
            self.failures.append(f"lost Redis: {e}")
            return True
        self.seen_stop |= stop is not None
        now = time.monotonic()
        for r in self.rollers:
            self._supervise_roller(r, stop, now)
        return self._rollers_ended(stop, now)

    def _learner_ended(self) -> bool:
        """The learner finished (the run is over) or failed with no restart left (recorded)."""
        if not self.learner or self.learner.proc is None:
            return False
        rc = self.learner.poll()
        if rc is None:
            return False
        if rc == 0:
            return True
        self._fault(self.learner, f"exited with code {rc}")
        if self.head and self.learner.restarts < self.learner_restarts:
            self._restart_learner(rc)
            return False
        self.failures.append(f"learner exited with code {rc} (see {self.learner.log_path})")
        return True

    def _follow_run(self) -> bool:
        """Head: watch the learner's endpoint and put back a config Redis lost. Other hosts: True
        once the head marked the run done; restart workers when the head's epoch advanced."""
        if self.head:
            self._check_endpoint()
            if self._config is not None and self.coord.get_config() is None:
                # Redis restarted empty: put back what new workers need to start.
                self.say("Redis lost the run's keys (restart without persistence); re-storing the config")
                self.coord.put_config(self._config)
            return False
        if self.state.done() is not None:
            return True
        epoch = self.state.epoch()
        if epoch != self.epoch:
            self.epoch = epoch
            self.say(f"learner restarted (epoch {epoch}); restarting {len(self.rollers)} worker(s)")
            self._restart_rollers()
        return False

    def _supervise_roller(self, r: ManagedProcess, stop: str | None, now: float) -> None:
        """Park a worker that exited because the run stopped; restart a failed one while it has restarts."""
        code = r.poll()
        if code is not None and r.proc is not None:
            if code == 0 or stop is not None:
                r.exit_codes.append(code)
                r.proc = None
                r.parked_since = now
                return
            self._fault(r, f"exited with code {code}")
            if r.schedule_restart():
                self.say(f"{r.name} exited with {code}; restart {r.restarts}/{r.max_restarts} "
                         f"in {r.backoff_s * 2 ** (r.restarts - 1):.0f} s")
            else:
                self.say(f"{r.name} exited with {code}; no restarts left")
                r.proc = None  # given up: its exit codes are recorded
        if r.restart_due():
            r.start()

    def _rollers_ended(self, stop: str | None, now: float) -> bool:
        """True (with the failure recorded) when every batch maker failed, or when a host without
        a learner has had all its processes parked longer than ``park_timeout_s``."""
        makers = [r for r in self.rollers if r.makes_batches]
        if makers and all(r.proc is None and not r.restarting and r.parked_since is None for r in makers):
            self.failures.append("all rollout workers failed" + ("" if self.single_host else " on this host"))
            if self.single_host:
                self.coord.request_stop("all rollout workers failed")
            return True
        if not self.learner and self.rollers and all(r.parked_since is not None for r in self.rollers):
            if now - min(r.parked_since for r in self.rollers) > self.park_timeout_s:
                self.failures.append(f"run stopped ({stop}) and neither finished nor restarted within "
                                     f"{self.park_timeout_s:.0f} s")
                return True
        return False

    def _restart_learner(self, rc: int) -> None:
        """Restart the failed learner with ``--resume``: workers keep running. Admission control and
        credits hold them back while the learner is away; it re-binds the same port, so what they
        queued is delivered (if it cannot, :meth:`_check_endpoint` restarts them)."""
        lr = self.learner
        lr.exit_codes.append(rc)
        lr.restarts += 1
        self.say(f"learner exited with {rc}; restart {lr.restarts}/{self.learner_restarts} with --resume")
        lr.stop(grace_s=0)  # reap stragglers of the old job
        self.state.clear_stop()
        self._old_endpoint = self.coord.get_endpoint("trajectories")
        lr.cmd = list(self.learner_restart_cmd)
        lr.start()
        for r in self.rollers:
            # Parked, or exited on a stop the old learner wrote that this loop has not
            # recorded yet: the run goes on, so the worker comes back.
            if r.proc is not None and r.poll() is not None:
                r.exit_codes.append(r.proc.returncode)
                r.proc = None
            if r.proc is None and not r.restarting:
                r.start()  # start() clears parked_since
        self._watch_endpoint_until = time.monotonic() + ENDPOINT_WATCH_S

    def _check_endpoint(self) -> None:
        """After a resume: if the learner could not re-bind its old port, workers (connected to
        the old one) must restart to find the new endpoint; their queued data is lost then."""
        if self._watch_endpoint_until is None:
            return
        if time.monotonic() > self._watch_endpoint_until:
            self._watch_endpoint_until = None
            return
        ep = self.coord.get_endpoint("trajectories")
        if ep and ep != self._old_endpoint and self.learner.alive():
            self._watch_endpoint_until = None
            self.say(f"learner moved its trajectory endpoint ({self._old_endpoint} -> {ep}); restarting workers")
            self.epoch = self.state.bump_epoch()
            self._restart_rollers()

    def _restart_rollers(self) -> None:
        for r in self.rollers:
            r.stop(grace_s=10)
            r.proc = None
            r.start()

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        reason = self.failures[0] if self.failures else "completed"
        if self.stop_signal is not None and not self.failures:
            reason = f"stopped on request ({signal_name(self.stop_signal)})"
        lr = self.learner
        if lr is not None and lr.alive():
            if self.head:
                self._safe(lambda: self.coord.stop_reason() or self.coord.request_stop(reason))
            grace = self._learner_grace_s()
            if not _wait(lr, grace):
                self.say(f"learner still running {grace:.0f} s after the stop request; SIGTERM")
                lr.signal(signal.SIGTERM)
                if not _wait(lr, self.stop_grace_s):
                    self.say("learner ignored SIGTERM; SIGKILL")
        if lr is not None:
            lr.stop(grace_s=1)
        if self.head:
            self._safe(lambda: self.coord.stop_reason() or self.coord.request_stop(reason))
        for r in self.rollers:
            r.stop(grace_s=10)
        if self.head:
            self._safe(lambda: self.state.set_done(reason))
            if not self.single_host:
                left = self._safe(lambda: self.state.wait_hosts_exited(15.0, self.host)) or []
                if left:
                    self.say(f"hosts still running after 15 s: {', '.join(left)}")
        self._safe(lambda: self.state.set_host(self.host, "exited"))

    def _learner_grace_s(self) -> float:
        """How long a stop request waits for the learner: ``stop_grace_s``, or three of its recent
        steps when those are longer (a step is finished before the checkpoint, and a 2-core run of a
        real model can spend minutes per step; cutting it short would lose the checkpoint)."""
        step_s = self.progress.last_step_s() if self.progress is not None else None
        if step_s is not None and 3 * step_s > self.stop_grace_s:
            self.say(f"waiting up to {3 * step_s:.0f} s (3 learner steps) for the learner to finish its step and save")
            return 3 * step_s
        return self.stop_grace_s

    @staticmethod
    def _safe(fn):
        try:
            return fn()
        except redis.RedisError:
            return None


def signal_name(signum: int) -> str:
    """``Ctrl-C`` for SIGINT, else the signal's name (``SIGTERM``)."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _wait(p: ManagedProcess, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not p.alive()


def exit_report(procs: list[ManagedProcess], summary_path: Path | None, failures: list[str]) -> str:
    """The exit summary: every process with its exit codes and restarts, the run's figures, the verdict."""
    lines = ["streamrl-launch: exit summary"]
    for p in procs:
        codes = p.exit_codes + ([p.proc.returncode] if p.proc is not None else [])
        lines.append(f"  {p.name:<14} exit codes {codes} restarts {p.restarts}  log {p.log_path}")
    if summary_path is not None and summary_path.exists():
        s = json.loads(summary_path.read_text())
        lines.append(f"  {s.get('status', '')}: steps {s.get('steps')} samples {s.get('samples')} "
                     f"wall {s.get('wall_s', 0):.1f}s reward {s.get('reward_first')} -> {s.get('reward_last')}  "
                     f"({summary_path})")
    lines += [f"  FAILED: {f}" for f in failures] or ["  OK"]
    return "\n".join(lines)
