"""Rollout worker entry point: generate with the newest weights, score, stream to the learner.

The loop never waits for the learner except through admission control: before each batch
the worker reserves capacity in Redis (at most ``max_staleness`` versions ahead of what the
learner accepts). After reserving it loads the newest published weights, so with
``max_staleness=0`` every sample is on-policy (the synchronous baseline). By default weights
change only between batches, so every token of a batch carries that batch's version.

With ``rollout.inflight_updates`` (engines hf_fast and vllm) the engine also calls back between
decode steps; the callback polls for a newer version at most every ``INFLIGHT_POLL_S``,
fetches and loads it mid-generation (PipelineRL-style), and each token carries the version
that sampled it (``policy_version`` per token). The learner's buffer measures a trajectory's
lag by its *oldest* token version, so a mixed-version trajectory counts as old as its first
tokens. KV computed before a switch is kept (see the engines).

With ``rollout.streaming`` (hf_fast) the worker runs one endless generation instead of batches
(:class:`streamrl.rollout.stream.StreamingRoller`): at each sync of the decode loop it reserves as
many prompt groups as there are free slots for (non-blocking), the engine's in-flight hook keeps
the weights current (per-token versions), and every ``prompts_per_batch`` finished groups go out
as one message. On stop the stream takes no new groups and drains; reservations it could not
deliver are refunded.

:mod:`streamrl.rollout` holds the Redis-free part (prompts -> engine -> rewards -> packed
trajectories): the worker builds its roller once from the config and drives it through
:class:`streamrl.rollout.base.Roller`.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

import torch

from streamrl.config import Config, config_from_dict
from streamrl.coord import liveness
from streamrl.coord.coordinator import Coordinator
from streamrl.coord.liveness import DeadlineExceeded
from streamrl.core_lending import make_core_borrower
from streamrl.engines.factory import build_engine
from streamrl.engines.hf import HFEngine
from streamrl.engines.parity import mismatch_metrics, probe_set
from streamrl.metrics import RateLimitedRedisSink
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.roles.annotate import trajectory_roles
from streamrl.roles.launch import reward_role_configured
from streamrl.roles.reward_wire import ENDPOINT as REWARD_ENDPOINT
from streamrl.rollout.factory import build_roller, run_reward
from streamrl.rollout.metrics import versions_spanned
from streamrl.rollout.timed_reward import reward_timeouts
from streamrl.rollout.prompts import PromptEncoder
from streamrl.tasks import build_task
from streamrl.tasks.sources import build_prompt_source
from streamrl.trajectory import make_id
from streamrl.transport.sender import TrajectorySender
from streamrl.utils import limit_threads, setup_logging
from streamrl.weights.factory import make_subscriber
from streamrl.weights.layout import ChecksumError

HEARTBEAT_S = 1.0
# Heartbeat states the learner reads: a worker "generating" holds reservations it will fill; one
# "waiting_admission" holds none and is blocked (see streamrl.learner.intake's starvation refund).
GENERATING, WAITING_ADMISSION = "generating", "waiting_admission"
# In-flight updates: the Redis look-up for a newer version runs at most this often.
INFLIGHT_POLL_S = 0.05


class _Handoff:
    """A load target that keeps the verified tensors for an engine that loads them itself
    (in-flight updates: the engine swaps weights between decode steps)."""

    tensors: list | None = None

    def load_weights(self, tensors) -> None:
        self.tensors = list(tensors)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="StreamRL rollout worker")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True, help="run id (Redis namespace)")
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--num-workers", type=int, default=1, help="prompt-space shards")
    p.add_argument("--device", default=None,
                   help="engine device, overriding rollout.device (streamrl-launch sets it per placement)")
    return p.parse_args(argv)


class RolloutWorker:
    def __init__(self, args):
        self.args = args
        self.wid = args.worker_id
        self.log = setup_logging(f"rollout[{self.wid}]")
        self.coord = Coordinator(args.redis_url, args.run_id)
        self.cfg = cfg = config_from_dict(self.coord.wait_config())
        self.coord.set_outage_s(cfg.deadlines.redis_outage_s)
        self.name = f"rollout-{self.wid}"
        if args.device:
            cfg.rollout.device = args.device
        self.incarnation = self.coord.next_incarnation(self.wid)
        torch.manual_seed(hash((cfg.run.seed, self.wid, self.incarnation)) & 0x7FFFFFFF)
        model, self.tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)  # the learner's model.dtype
        self.engine = build_engine(cfg, model, self.tok)  # hf engines cast it to rollout.dtype, in place
        task = build_task(cfg.task)
        self.reference, self.probes = self._parity_reference(model, task)
        problems = build_prompt_source(cfg, task, cfg.run.seed * 7919 + self.incarnation,
                                       self.wid, max(args.num_workers, self.wid + 1))
        self.reward = run_reward(cfg, self._reward_endpoint())
        self.roller = build_roller(cfg, self.engine, self.tok, problems, worker_id=self.wid, next_id=self._next_id,
                                   reward=self.reward,
                                   before_turn=self.between_turns if cfg.rollout.inflight_updates else None,
                                   task=task)
        self.roles = trajectory_roles(cfg, self.coord)  # reference/critic servers, when placed apart (or None)
        self.subscriber = make_subscriber(self.coord, cfg, worker_id=self.wid)
        self.metrics = RateLimitedRedisSink(self.coord, f"rollout-{self.wid}")
        self.counter = 0
        self.stopping = False
        self.state = "starting"
        self.phase, self.phase_since = liveness.STARTING, time.time()
        self.progress = {"batches": 0, "trajectories": 0, "tokens": 0}  # grows while the worker works
        self.threads = torch.get_num_threads()  # read here: the heartbeat thread's own count is not this one
        self.host = socket.gethostname()
        self._last_poll = 0.0
        self._refused_since: float | None = None  # monotonic time admission was first refused in a row
        self.inflight_loads = 0
        # the engine's in-flight weights hook is on with rollout.inflight_updates, and always when
        # streaming: an endless generation has no batch boundary to load new weights at
        self.inflight = cfg.rollout.inflight_updates or cfg.rollout.streaming
        # decode with the colocated CPU learner's cores while it waits for data (streamrl.core_lending)
        self.borrower = make_core_borrower(cfg, self.coord)

    def _parity_reference(self, model, task) -> tuple[HFEngine | None, tuple | None]:
        """``(reference, probes)`` for ``rollout.parity_probes > 0``: a learner-side HF model (its own
        copy when the engine shares ``model``) and the probe sequences; ``(None, None)`` otherwise."""
        cfg = self.cfg
        if cfg.rollout.parity_probes <= 0:
            return None, None
        shares_model = cfg.rollout.engine in ("hf", "hf_fast")
        ref_model = load_model_and_tokenizer(cfg.model, cfg.run.seed)[0] if shares_model else model
        encode = PromptEncoder(self.tok, cfg.rollout.chat_template)
        return HFEngine(ref_model, self.tok), probe_set(task, encode, cfg.rollout.parity_probes, cfg.run.seed)

    def _reward_endpoint(self):
        """The reward-model role's address, re-read after its restarts; None when no role scores."""
        if not reward_role_configured(self.cfg):
            return None
        self.coord.wait_endpoint(REWARD_ENDPOINT, timeout_s=self.cfg.deadlines.endpoint_s)
        return lambda: self.coord.get_endpoint(REWARD_ENDPOINT)

    def _next_id(self) -> int:
        self.counter += 1
        return make_id(self.wid, self.counter, self.incarnation)

    def sync_weights(self) -> float:
        """Load the newest version if there is one (and check parity); returns seconds spent."""
        t0 = time.perf_counter()
        try:
            v = self.subscriber.load(self._with_reference(self.engine), self.wid)
        except ChecksumError as e:
            self.log.warning("%s; will re-fetch", e)
            return time.perf_counter() - t0
        if v is None:  # nothing newer, or superseded while we looked (the next round finds it)
            return 0.0
        load_s = time.perf_counter() - t0
        if self.probes is not None:
            self.metrics.write({**self.parity(), "rollout/parity_version": v})
        return load_s

    def between_turns(self) -> int:
        """Multi-turn episodes with in-flight updates: before each turn load a newer version if
        there is one; the version the turn samples with (recorded per token)."""
        self.sync_weights()
        return self.subscriber.loaded_version

    def between_steps(self):
        """In-flight hook for the engine: ``(version, tensors)`` of a newer version, or None.

        Polls Redis at most every ``INFLIGHT_POLL_S``; loads the reference model (parity) and
        acks the version here, the engine loads the returned tensors right after. The parity
        probe is not scored for versions loaded mid-batch (it would stall every sequence); the
        next version loaded at a batch boundary is scored as usual.
        """
        now = time.monotonic()
        if now - self._last_poll < INFLIGHT_POLL_S:
            return None
        self._last_poll = now
        handoff = _Handoff()  # the engine loads them itself, between two decode steps
        try:
            v = self.subscriber.load(self._with_reference(handoff), self.wid)
        except ChecksumError as e:
            self.log.warning("%s; will re-fetch", e)
            return None
        if v is None:
            return None
        self.inflight_loads += 1
        return v, handoff.tensors

    def _step_hook(self):
        """The engine's per-step hook: take or give back the learner's threads (core borrowing),
        then the in-flight update check if that is on."""
        self.borrower.apply()
        return self.between_steps() if self.inflight else None

    def _with_reference(self, target) -> list:
        return [self.reference, target] if self.reference is not None else [target]

    def parity(self) -> dict[str, float]:
        """``rollout/mismatch_kl`` etc. between engine and HF reference on the probe set."""
        seqs, starts = self.probes
        return mismatch_metrics(self.engine.score(seqs, starts), self.reference.score(seqs, starts))

    def heartbeat(self, state: str, phase: str | None = None) -> None:
        """Record ``state`` (what the learner reads: does the worker hold a reservation) and the
        ``phase`` (:mod:`streamrl.coord.liveness`: what stall detection reads); send one now."""
        self.state = state
        if phase is not None and phase != self.phase:
            self.phase, self.phase_since = phase, time.time()
        self._send_heartbeat()

    def _send_heartbeat(self) -> None:
        self.coord.heartbeat(self.wid, {
            "host": self.host, "pid": os.getpid(), "device": self.cfg.rollout.device,
            "version": self.subscriber.loaded_version, "state": self.state, "incarnation": self.incarnation,
            "engine": self.cfg.rollout.engine,
            "threads": self.threads,  # what a colocated CPU learner may borrow while this worker waits
            "phase": self.phase, "phase_since": self.phase_since, **self.progress,
        }, ttl_s=self.cfg.deadlines.heartbeat_s)

    def _heartbeat_loop(self, done: threading.Event) -> None:
        """Beat every ``HEARTBEAT_S`` from a thread: one batch at real lengths (and the first
        one's compile) takes far longer than the heartbeat TTL, and a worker that beats only
        between batches would be declared gone (and its reservations refunded) while it works."""
        while not done.wait(HEARTBEAT_S):
            try:
                self._send_heartbeat()
            except Exception as e:  # noqa: BLE001 - Redis down: the main loop's retries handle outages
                self.log.debug("heartbeat failed: %s", e)

    def run(self) -> int:
        rc = self.cfg.rollout
        endpoint = self.coord.wait_endpoint("trajectories", timeout_s=self.cfg.deadlines.endpoint_s)
        sender = TrajectorySender(endpoint, self.wid, hwm=self.cfg.transport.hwm,
                                  retain_bytes=self.cfg.transport.retain_bytes)
        self.log.info("connected to %s (incarnation %d, engine %s)", endpoint, self.incarnation, rc.engine)
        totals = {"tokens": 0, "trajectories": 0, "wait_s": 0.0, "t_start": time.perf_counter()}
        self.heartbeat("running")
        beating = threading.Event()
        threading.Thread(target=self._heartbeat_loop, args=(beating,), name="heartbeat", daemon=True).start()
        try:
            if rc.streaming:
                self._stream(sender, totals)
            while not rc.streaming and not self.stopping and self.coord.stop_reason() is None:
                if not self._admitted(sender, totals):
                    continue
                self.heartbeat(GENERATING, liveness.LOADING_WEIGHTS)
                load_s = self.sync_weights()
                if self.subscriber.loaded_version < 0:
                    self.coord.refund(rc.prompts_per_batch)
                    time.sleep(0.05)
                    continue
                self._one_batch(sender, load_s, totals)
        finally:
            beating.set()
            self._shutdown(sender)
        self.log.info("stopping: %s; sent %d trajectories", self.coord.stop_reason() or "signal",
                      totals["trajectories"])
        return 0

    def _admitted(self, sender: TrajectorySender, totals: dict) -> bool:
        """One admission attempt: True once a batch's prompt groups are reserved. Refused: see :meth:`_refused`."""
        rc, lc = self.cfg.rollout, self.cfg.learner
        if self.coord.try_reserve(rc.prompts_per_batch, lc.max_staleness, lc.groups_per_step):
            self._refused_since = None
            return True
        self._refused(sender, totals, rc.prompts_per_batch)
        return False

    def _refused(self, sender: TrajectorySender, totals: dict, groups: int) -> None:
        """Admission refused with nothing in flight: service the sender (acks, resends), wait a
        moment; refused for ``deadlines.admission_s`` in a row raises :class:`DeadlineExceeded`
        naming the learner's version (it made no progress)."""
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
        if self.state != WAITING_ADMISSION:
            self.heartbeat(WAITING_ADMISSION, liveness.WAITING_ADMISSION)
        if now - self._refused_since > self.cfg.deadlines.admission_s:
            raise DeadlineExceeded(self.name, f"admission of {groups} prompt groups (the learner "
                                   f"stayed at version {self.coord.current_version()})", now - self._refused_since,
                                   f"deadlines.admission_s = {self.cfg.deadlines.admission_s:g} s")
        sender.service()  # acks; resends what a restarted learner lost
        time.sleep(0.02)
        totals["wait_s"] += 0.02

    def _send(self, sender: TrajectorySender, td) -> bool:
        """Send one batch, waiting out backpressure (credits, retention) up to ``deadlines.deliver_s``;
        False when the worker stopped while blocked (the batch was not sent)."""
        t0 = time.monotonic()
        while not sender.send(td, timeout_s=1.0):  # blocked by backpressure
            if self.coord.stop_reason() is not None or self.stopping:
                return False
            waited = time.monotonic() - t0
            if waited > self.cfg.deadlines.deliver_s:
                raise DeadlineExceeded(self.name, "the learner to accept a batch (send credits or retention full)",
                                       waited, f"deadlines.deliver_s = {self.cfg.deadlines.deliver_s:g} s")
            self.heartbeat("backpressure", liveness.SENDING)
        return True

    def _one_batch(self, sender: TrajectorySender, load_s: float, totals: dict) -> None:
        """Generate one batch with the loaded version, send it (waiting out backpressure) and
        write its figures; ``totals`` accumulates the worker's counters."""
        t_gen = time.perf_counter()
        self.heartbeat(GENERATING, liveness.GENERATING)
        try:
            td = self.roller.rollout_batch(self.subscriber.loaded_version, self._hook())
        finally:
            if self.borrower is not None:
                self.borrower.end_batch()
        gen_s = time.perf_counter() - t_gen
        if self.roles is not None:
            td = self.roles(td)
        self._send(sender, td)
        self._record(sender, td, gen_s, load_s, totals)

    def _hook(self):
        """The engine's per-step hook: core borrowing and/or in-flight updates (streaming implies them)."""
        if self.borrower is not None:
            return self._step_hook
        return self.between_steps if self.inflight else None

    def _stream(self, sender: TrajectorySender, totals: dict) -> None:
        """Streaming mode: one endless generation until stop (stop key or signal), then drain.
        Groups are reserved as slots free (:meth:`_reserve`); reservations never delivered are
        refunded on the way out."""
        while self.subscriber.loaded_version < 0:  # nothing to sample with before the first version
            if self.stopping or self.coord.stop_reason() is not None:
                return
            self.sync_weights()
            if self.subscriber.loaded_version < 0:
                self._refused(sender, totals, self.cfg.rollout.prompts_per_batch)
        self._refused_since = None
        flow = {"reserved": 0, "sent": 0, "t": time.perf_counter()}

        def send(td) -> None:
            groups = int(td["reward"].numel()) // self.cfg.rollout.group_size
            if self.roles is not None:
                td = self.roles(td)
            if self._send(sender, td):
                flow["sent"] += groups
            now = time.perf_counter()
            self._record(sender, td, now - flow["t"], self.subscriber.timings.get("weights/load_s", 0.0), totals)
            flow["t"] = now
            # a message out is the stream's batch boundary: the working phase starts over, so stall
            # detection (deadlines.batch_s) bounds the time between messages, not the whole stream
            self.state, self.phase, self.phase_since = GENERATING, liveness.GENERATING, time.time()
            self._send_heartbeat()

        stop = lambda: self.stopping or self.coord.stop_reason() is not None  # noqa: E731
        self.heartbeat(GENERATING, liveness.GENERATING)
        try:
            self.roller.run(lambda k: self._reserve(k, sender, totals, flow), send,
                            self.subscriber.loaded_version, self._hook(), stop)
        finally:
            if self.borrower is not None:
                self.borrower.end_batch()
            try:  # groups reserved but never delivered (an error, or a send given up on stop)
                self.coord.refund(flow["reserved"] - flow["sent"])
            except Exception as e:  # noqa: BLE001 - Redis gone: keep the error that ended the stream
                self.log.warning("refund of %d undelivered group(s) failed: %s", flow["reserved"] - flow["sent"], e)

    def _reserve(self, k: int, sender: TrajectorySender, totals: dict, flow: dict) -> int:
        """Streaming admission: reserve as many of ``k`` groups as the staleness budget takes now (one
        Redis call); refused with nothing in flight: :meth:`_refused` (wait, deadline)."""
        lc = self.cfg.learner
        n = self.coord.try_reserve_up_to(k, lc.max_staleness, lc.groups_per_step)
        if n > 0:
            self._refused_since = None
            flow["reserved"] += n
            if self.state != GENERATING:
                self.heartbeat(GENERATING, liveness.GENERATING)
            return n
        if self.roller.in_flight:  # slots still busy: ask again at the next sync
            self._refused_since = None
            return 0
        if self.borrower is not None:  # idle until admitted: the learner gets its threads back
            self.borrower.end_batch()
        self._refused(sender, totals, k)
        return 0

    def _record(self, sender: TrajectorySender, td, gen_s: float, load_s: float, totals: dict) -> None:
        """Count a sent message in ``totals`` and the heartbeat's progress, and write its figures."""
        n_tok = int(td["response_lens"].sum())
        totals["tokens"] += n_tok
        totals["trajectories"] += int(td["reward"].numel())
        self.progress = {"batches": self.progress["batches"] + 1, "trajectories": totals["trajectories"],
                         "tokens": totals["tokens"]}
        elapsed = time.perf_counter() - totals["t_start"]
        self.metrics.write({
            "rollout/tokens_per_s_batch": n_tok / max(gen_s, 1e-9),
            "rollout/generated_tokens": totals["tokens"],
            "rollout/trajectories": totals["trajectories"],
            "rollout/reward_mean": float(td["reward"].mean()),
            "rollout/version": self.subscriber.loaded_version,
            "rollout/weights_load_s": load_s,
            "rollout/admission_wait_s": totals["wait_s"],
            "rollout/tokens_per_s": totals["tokens"] / max(elapsed, 1e-9),
            "rollout/inflight_loads": self.inflight_loads,
            "rollout/reward_timeouts": reward_timeouts(self.reward.fns),  # plug-in calls past deadlines.reward_s
            **sender.stats(),  # transport/produced, retained and resent messages, ...
            **self.subscriber.timings,  # weights/transfer_s, verify_s, load_s of the newest load
            **self.roller.last_metrics,  # rollout/truncated, env/... of multi-turn episodes
            **versions_spanned(td["policy_version"], td["response_lens"]),  # in-flight drift
            **(self.borrower.metrics() if self.borrower is not None else {}),
        })

    def _shutdown(self, sender: TrajectorySender) -> None:
        """Deliver what is in flight if the run goes on without us, then release everything."""
        try:  # leaving a live run (signal): give sent trajectories a moment to become durable
            if self.coord.stop_reason() is None and not sender.flush(timeout_s=3.0, durable=True):
                self.log.warning("leaving with %d messages not yet acknowledged by the learner",
                                 sender.retention.pending())
        except Exception as e:  # Redis or socket already gone: nothing more to deliver
            self.log.warning("flush on exit skipped: %s", e)
        sender.close()
        if self.borrower is not None:
            self.borrower.close()
        self.metrics.close()
        if self.roles is not None:
            self.roles.close()
        self.roller.close()  # multi-turn: the env and tool pools
        self.engine.close()


def main(argv=None) -> int:
    limit_threads()
    worker = RolloutWorker(parse_args(argv))

    def on_signal(signum, frame):
        worker.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
