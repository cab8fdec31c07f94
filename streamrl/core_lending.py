"""Core lending between a CPU learner and its colocated rollout workers: each side runs with the cores the other leaves idle.

Lending to the learner (:class:`CoreLender`). Why: on a small CPU host (2 cores, 1 learner + 1 worker, one core each by
:func:`streamrl.placement.assign_threads`) the learner is the bottleneck, and the worker spends
a large part of each learner step blocked in admission control (the staleness limit) with its
core idle (40-55 % of the step in the loop of ``configs/smol-dense.yaml``; generating its 8 x 8
batch takes the rest). A fixed 2-thread learner beside the worker is slower (the threads fight
the worker's while it generates), so the learner borrows the worker's threads only while the
worker says it does not need them, and gives them back as soon as it starts generating.

How:

* The placement tells the learner how many intra-op threads this host's CPU rollout workers
  were given (``STREAMRL_LENDABLE_THREADS``, set by ``assign_threads``): no more is ever lent.
* A daemon thread polls the worker heartbeats in Redis every ``poll_s`` (one MGET; the worker
  writes its heartbeat at once on every state change) and keeps the offer: the threads of
  colocated workers (same host) in an idle state, ``waiting_admission`` or ``backpressure``.
  A worker in any other state (generating, loading weights, starting) or with no live
  heartbeat lends nothing. The training thread never touches Redis.
* Idle by the heartbeat is not enough on a shared host: another tenant's process may run on
  the worker's core, and a borrowed thread that is descheduled makes every parallel op of the
  learner wait for it (2 learner threads under outside load ran a step ~2x slower than 1). So
  the poller also measures, from ``/proc/stat`` over the last ``LOAD_WINDOW_S``, the cores the
  host's *other* processes keep busy, and lends only the cores that are really free
  (:class:`HostLoad`; without ``/proc/stat`` the heartbeats alone decide).
* The training thread calls :meth:`CoreLender.apply` at cheap points: before each decoder
  layer's forward and before its backward (hooks from :meth:`CoreLender.attach`), and between
  steps. ``torch.set_num_threads`` must run on the training thread itself (OpenMP keeps the
  thread count per calling thread); it costs a few microseconds and only runs on a change.
  Give-back latency is therefore one poll plus one decoder layer (~0.1-0.3 s on SmolLM2-135M).

Lending to a worker (:class:`CoreBorrower`, the reverse direction). Why: once the learner
trains fast, the worker is the bottleneck and the learner blocks for its next batch with its
core idle. How:

* The placement tells each CPU worker how many of a colocated CPU learner's threads are its
  share (``STREAMRL_BORROWABLE_THREADS``: the learner's threads split over the host's CPU
  workers); no more is ever borrowed.
* Rank 0 of the learner publishes its phase in Redis (:class:`LearnerPhase`: one SET per
  change), ``waiting`` only while it blocks for its next batch. The worker's daemon thread reads it every
  ``poll_s`` (one GET) and keeps the offer: the share while the learner on this host waits, else 0.
  The decode thread never touches Redis.
* Only cores that are really free are borrowed: the poller also measures the host's other
  processes' load from ``/proc/stat`` (:class:`HostLoad`, the learner's own check) and a borrowed thread that another tenant would deschedule is not taken.
* The decode thread calls :meth:`CoreBorrower.apply` before the prefill and before every decode
  step (the engine's ``between_steps`` hook, :mod:`streamrl.engines.decode_loop`): on CPU the
  step is eager, so a thread count changed between two steps applies to the next one, and
  ``torch.set_num_threads`` must run on the decode thread itself (OpenMP keeps it per calling
  thread). Give-back latency: one poll plus one decode step (~0.5 s for SmolLM2-135M at batch 64).
* Never both sides at once: the worker borrows only while generating and only while the learner
  says ``waiting`` (no compute); the learner borrows only while the worker's heartbeat says it
  waits (no compute). Each side's switch lags the other's state change by at most one poll
  plus one step (decode step or decoder layer).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import torch
from torch import nn

from streamrl.parallel.expert_parallel import decoder_layers

log = logging.getLogger(__name__)
# Worker heartbeat states (workers/rollout.py) in which it does no compute: blocked in
# admission control, or blocked on a full trajectory socket.
IDLE_STATES = frozenset({"waiting_admission", "backpressure"})
LENDABLE_ENV = "STREAMRL_LENDABLE_THREADS"
BORROWABLE_ENV = "STREAMRL_BORROWABLE_THREADS"
POLL_S = 0.05
LOAD_WINDOW_S = 0.5
# A core counts as free when others use less than this much of it (the waiting worker's
# admission polls and Redis take ~0.05-0.1 of a core).
FREE_SLACK = 0.3


def lendable_threads() -> int:
    """Threads this host's CPU rollout workers were placed with (0: nothing may be lent)."""
    return int(os.environ.get(LENDABLE_ENV, "0") or 0)


class HostLoad:
    """Cores kept busy by the host's other processes (all but this one), over the last ``window_s``.

    From ``/proc/stat`` (every CPU's busy jiffies) minus this process's own CPU time
    (``os.times()``, all its threads). :meth:`open` returns None where ``/proc/stat`` is missing.
    """

    def __init__(self, window_s: float = LOAD_WINDOW_S):
        self.window_s = window_s
        self.cpus = os.cpu_count() or 1
        self._tick = os.sysconf("SC_CLK_TCK")
        self._samples: list[tuple[float, float, float]] = []  # (wall, host busy CPU-s, own CPU-s)

    @classmethod
    def open(cls, window_s: float = LOAD_WINDOW_S) -> HostLoad | None:
        try:
            load = cls(window_s)
            load.sample()
            return load
        except (OSError, ValueError, IndexError):
            return None

    def sample(self) -> float | None:
        """Take a sample; returns the other processes' busy cores over the window (None: too few samples)."""
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        busy = (sum(fields[:8]) - idle) / self._tick  # user..steal; guest time is inside user
        own = sum(os.times()[:2])
        now = time.monotonic()
        self._samples.append((now, busy, own))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.pop(0)  # keep the newest sample at least a window old
        t0, busy0, own0 = self._samples[0]
        if now - t0 < self.window_s / 2:
            return None
        return max(0.0, ((busy - busy0) - (own - own0)) / (now - t0))

    def free_threads(self, own_threads: int, last_busy: float) -> tuple[int, float]:
        """``(threads free beside this process's own, others' busy cores)`` from a new sample;
        ``last_busy`` stands in while the window is not full yet."""
        busy = self.sample()
        busy = last_busy if busy is None else busy
        return int(self.cpus - own_threads - busy + FREE_SLACK), busy


class PollingThread:
    """A daemon thread that calls :meth:`poll` every ``poll_s`` seconds until :meth:`close`
    (the lender's heartbeat poller here, the worker's phase poller, :class:`CoreBorrower`)."""

    poll_s: float
    thread_name = "poller"
    _thread: threading.Thread | None = None  # set by start()

    def poll(self) -> int:
        raise NotImplementedError

    def start(self):
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def _poll_loop(self) -> None:
        while not self._done.wait(self.poll_s):
            self.poll()

    def close(self) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join(5)


class CoreLender(PollingThread):
    """Lends the learner rank the intra-op threads of colocated idle workers.

    Args:
        coord: a :class:`~streamrl.coord.coordinator.Coordinator` (its Redis client is used from
            the polling thread only).
        base_threads: the rank's own threads (``torch.get_num_threads()`` at start).
        lendable: most threads this rank may borrow (the placement's share for this rank).
        host: the host name workers report in their heartbeats (default: this host).
        poll_s: seconds between heartbeat polls.
        host_load: the host's other processes' load (:class:`HostLoad`); only cores they leave
            free are lent. None: the heartbeats alone decide (no ``/proc/stat``).
    """

    def __init__(self, coord, base_threads: int, lendable: int, host: str | None = None, poll_s: float = POLL_S,
                 host_load: HostLoad | None = None):
        assert base_threads >= 1 and lendable >= 0, (base_threads, lendable)
        self.coord, self.base, self.lendable, self.poll_s = coord, base_threads, lendable, poll_s
        self.host_load = host_load
        self.others_busy = 0.0
        """Cores the host's other processes kept busy over the last window (0 without host_load)."""
        self.host = host or socket.gethostname()
        self.offer = 0
        """Threads the idle colocated workers leave now (written by the poller, read by apply)."""
        self.threads = base_threads
        """Threads the training thread runs with now."""
        self.switches = 0
        self._hooks: list = []
        now = time.monotonic()
        self._t_apply = self._t_poll = self._t_window = now
        self._lent_thread_s = self._lent_s = 0.0  # training-thread time with lent threads (weighted / any)
        self._idle_s = 0.0  # poller: time every colocated worker was idle
        self._others_s = 0.0  # poller: other processes' busy cores x time

    # -- the polling thread ------------------------------------------------------------------
    thread_name = "core-lender"

    def poll(self) -> int:
        """Read the heartbeats once and update :attr:`offer`; returns it."""
        try:
            beats = self.coord.workers()
        except Exception as e:  # noqa: BLE001 - Redis down: lend nothing until it is back
            log.debug("core lending: heartbeat poll failed: %s", e)
            beats = {}
        here = [hb for hb in beats.values() if hb is not None and hb.get("host") == self.host]
        idle = [hb for hb in here if hb.get("state") in IDLE_STATES]
        now = time.monotonic()
        if here and len(idle) == len(here):
            self._idle_s += now - self._t_poll
        self._others_s += self.others_busy * (now - self._t_poll)
        self._t_poll = now
        offer = min(self.lendable, sum(int(hb.get("threads", 1)) for hb in idle))
        if self.host_load is not None:
            free, self.others_busy = self.host_load.free_threads(self.base, self.others_busy)
            offer = max(0, min(offer, free))
        self.offer = offer
        return self.offer

    def close(self) -> None:
        """Stop polling, remove the layer hooks and give every borrowed thread back."""
        super().close()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.offer = 0
        self.apply()

    # -- the training thread -----------------------------------------------------------------
    def apply(self) -> int:
        """Run with ``base + offer`` threads from now on (training thread only); returns the count."""
        want = self.base + self.offer
        if want != self.threads:
            now = time.monotonic()
            self._account(now)
            torch.set_num_threads(want)
            self.threads = want
            self.switches += 1
        return self.threads

    def _account(self, now: float) -> None:
        lent, dt = self.threads - self.base, now - self._t_apply
        self._lent_thread_s += lent * dt
        self._lent_s += dt if lent > 0 else 0.0
        self._t_apply = now

    def attach(self, model: nn.Module) -> int:
        """Call :meth:`apply` before every decoder layer's forward and backward; returns the layer count."""
        layers = decoder_layers(model)
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self._before_forward))
            self._hooks.append(layer.register_forward_hook(self._after_forward))
        return len(layers)

    def _before_forward(self, module, args) -> None:
        self.apply()

    def _after_forward(self, module, args, output) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._before_backward)  # runs when the layer's output grad is ready

    def _before_backward(self, grad: torch.Tensor) -> None:
        self.apply()

    def metrics(self) -> dict[str, float]:
        """Since the last call: share of time the training thread ran with lent threads, mean lent
        threads, share of time every colocated worker was idle, thread switches, and the mean
        cores the host's other processes (the workers included) kept busy (0 without host_load)."""
        now = time.monotonic()
        self._account(now)
        span = max(now - self._t_window, 1e-9)
        out = {"learner/lent_frac": self._lent_s / span, "learner/lent_threads_mean": self._lent_thread_s / span,
               "learner/workers_idle_frac": min(1.0, self._idle_s / span), "learner/lend_switches": self.switches,
               "learner/others_busy_cores": self._others_s / span}
        self._lent_s = self._lent_thread_s = self._idle_s = self._others_s = 0.0
        self.switches = 0
        self._t_window = now
        return out


# The learner's phase, read by colocated CPU rollout workers (:class:`CoreBorrower`).
WAITING, BUSY = "waiting", "busy"


def phase_key(coord) -> str:
    """Redis key of the learner's phase: JSON ``{"phase", "host", "threads"}``."""
    return coord.keys._k("learner", "phase")


class LearnerPhase:
    """Rank 0 tells this host's CPU rollout workers whether the learner computes.

    ``waiting`` only while it blocks for its next batch (every rank is then idle: the others
    wait in the batch broadcast), ``busy`` otherwise (training, publishing, checkpointing,
    starting). One SET per change from the training thread (~0.1 ms, twice a step). A stale
    ``waiting`` (Redis outage, killed learner) is harmless: a worker lends only cores that
    ``/proc/stat`` shows free.
    """

    def __init__(self, coord, threads: int, host: str | None = None):
        self.r, self.key = coord.r, phase_key(coord)
        self.host, self.threads = host or socket.gethostname(), threads
        self.phase: str | None = None

    def set(self, phase: str) -> None:
        assert phase in (WAITING, BUSY), phase
        if phase == self.phase:
            return
        try:
            self.r.set(self.key, json.dumps({"phase": phase, "host": self.host, "threads": self.threads}))
            self.phase = phase
        except Exception as e:  # noqa: BLE001 - Redis down: workers' reads fail too and they lend nothing
            log.debug("learner phase not published: %s", e)
            self.phase = None

    def close(self) -> None:
        try:
            self.r.delete(self.key)
        except Exception as e:  # noqa: BLE001 - Redis already gone
            log.debug("learner phase not removed: %s", e)


def make_learner_phase(cfg, coord, local_ranks: int) -> LearnerPhase | None:
    """Rank 0's phase publisher when ``placement.lend_idle_cores`` is on and the learner runs on CPU;
    it starts ``busy``. None otherwise."""
    if not cfg.placement.lend_idle_cores or not cfg.learner.device.startswith("cpu"):
        return None
    phase = LearnerPhase(coord, torch.get_num_threads() * max(local_ranks, 1))
    phase.set(BUSY)
    return phase


def make_core_lender(cfg, coord, local_ranks: int) -> CoreLender | None:
    """The rank's lender when ``placement.lend_idle_cores`` is on and the placement left this host's
    worker threads to lend (CPU learner and workers on one host); None otherwise. Started."""
    lendable = lendable_threads() // max(local_ranks, 1)
    if not cfg.placement.lend_idle_cores or lendable < 1 or not cfg.learner.device.startswith("cpu"):
        return None
    lender = CoreLender(coord, torch.get_num_threads(), lendable, host_load=HostLoad.open()).start()
    log.info("core lending on: %d thread(s) of its own, up to %d borrowed from idle colocated workers",
             lender.base, lendable)
    return lender

def borrowable_threads() -> int:
    """This worker's share of the colocated CPU learner's threads (0: nothing may be borrowed)."""
    return int(os.environ.get(BORROWABLE_ENV, "0") or 0)


class CoreBorrower(PollingThread):
    """Lends a CPU rollout worker the colocated learner's threads while the learner waits.

    Args:
        coord: a :class:`~streamrl.coord.coordinator.Coordinator` (its Redis client is used from
            the polling thread only).
        base_threads: the worker's own threads (``torch.get_num_threads()`` at start).
        borrowable: most threads this worker may borrow (its placement share).
        host: the host name the learner reports with its phase (default: this host).
        poll_s: seconds between phase polls.
        host_load: the host's other processes' load; only cores they leave free are borrowed.
            None: the learner's phase alone decides (no ``/proc/stat``).
    """

    def __init__(self, coord, base_threads: int, borrowable: int, host: str | None = None, poll_s: float = POLL_S,
                 host_load: HostLoad | None = None):
        assert base_threads >= 1 and borrowable >= 0, (base_threads, borrowable)
        self.coord, self.base, self.borrowable, self.poll_s = coord, base_threads, borrowable, poll_s
        self.key = phase_key(coord)
        self.host = host or socket.gethostname()
        self.host_load = host_load
        self.others_busy = 0.0
        """Cores the host's other processes (the learner included) kept busy over the last window."""
        self.offer = 0
        """Threads the waiting learner leaves now (written by the poller, read by apply)."""
        self.threads = base_threads
        """Threads the decode thread runs with now."""
        self.switches = 0
        self._t_apply: float | None = None  # None: outside a batch (no decode time accrues)
        self._gen_s = self._borrowed_s = self._borrowed_thread_s = 0.0

    # -- the polling thread ------------------------------------------------------------------
    thread_name = "core-borrower"

    def poll(self) -> int:
        """Read the learner's phase once and update :attr:`offer`; returns it."""
        try:
            raw = self.coord.r.get(self.key)
        except Exception as e:  # noqa: BLE001 - Redis down: borrow nothing until it is back
            log.debug("core borrowing: phase poll failed: %s", e)
            raw = None
        state = json.loads(raw) if raw else {}
        waiting = state.get("phase") == WAITING and state.get("host") == self.host
        offer = self.borrowable if waiting else 0
        if self.host_load is not None:
            free, self.others_busy = self.host_load.free_threads(self.base, self.others_busy)
            offer = max(0, min(offer, free))
        self.offer = offer
        return offer

    # -- the decode thread -------------------------------------------------------------------
    def apply(self) -> int:
        """Run with ``base + offer`` threads from now on (decode thread only); returns the count."""
        now = time.monotonic()
        if self._t_apply is None:
            self._t_apply = now
        want = self.base + self.offer
        if want != self.threads:
            self._account(now)
            torch.set_num_threads(want)
            self.threads = want
            self.switches += 1
        return self.threads

    def end_batch(self) -> None:
        """A batch's decoding is over: back to the worker's own threads (decode thread only)."""
        if self._t_apply is not None:
            self._account(time.monotonic())
            self._t_apply = None
        if self.threads != self.base:
            torch.set_num_threads(self.base)
            self.threads = self.base
            self.switches += 1

    def _account(self, now: float) -> None:
        extra, dt = self.threads - self.base, now - self._t_apply
        self._gen_s += dt
        self._borrowed_s += dt if extra > 0 else 0.0
        self._borrowed_thread_s += extra * dt
        self._t_apply = now

    def metrics(self) -> dict[str, float]:
        """Since the last call: share of generation time with borrowed threads, mean borrowed
        threads over that time, thread switches, and the others' busy cores (last window)."""
        gen = max(self._gen_s, 1e-9)
        out = {"rollout/borrowed_frac": self._borrowed_s / gen, "rollout/borrowed_threads_mean":
               self._borrowed_thread_s / gen, "rollout/borrow_switches": self.switches,
               "rollout/others_busy_cores": self.others_busy}
        self._gen_s = self._borrowed_s = self._borrowed_thread_s = 0.0
        self.switches = 0
        return out


def make_core_borrower(cfg, coord) -> CoreBorrower | None:
    """The worker's borrower when ``placement.lend_idle_cores`` is on, the worker decodes on CPU with
    an engine that calls back between decode steps (hf_fast), single-turn, and the placement gave
    it a share of a colocated CPU learner's threads; None otherwise. Started."""
    rc = cfg.rollout
    share = borrowable_threads()
    if (not cfg.placement.lend_idle_cores or share < 1 or not rc.device.startswith("cpu")
            or rc.engine != "hf_fast" or cfg.env.name != "none"):
        return None
    borrower = CoreBorrower(coord, torch.get_num_threads(), share, host_load=HostLoad.open()).start()
    log.info("core borrowing on: %d thread(s) of its own, up to %d borrowed while the learner waits",
             borrower.base, share)
    return borrower
