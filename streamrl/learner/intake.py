"""Rank 0's intake: everything between the trajectory socket and a training batch, in one object.

The learner loop asks for ``intake.next_batch(version)`` and gets ``groups_per_step`` complete,
fresh prompt groups (or None: stop). Behind that call, in this order for every message:

1. the **source** (``TrajectoryReceiver``, or the in-process ``LocalFeed`` in tests) decodes and
   validates it and counts what it rejects;
2. :class:`SeenIds` drops trajectory ids the learner already holds (checkpoint, journal or
   trained), so a worker's resend after a learner restart never trains twice;
3. the learner gate: trajectories of workers that never registered are rejected and counted;
4. the **journal** appends the batch (durable from here: the source acknowledges it, and the
   worker forgets it; see :mod:`streamrl.transport.retention`);
5. the **ledger** counts it and the **staleness buffer** groups it.

Admission control (the workers reserve prompt groups in Redis, at most ``max_staleness``
versions ahead) is balanced here too: :class:`Admission` is the one place that computes what
``reserved - refunded`` should be and gives reservations back (stale drops, a worker that
left, a starving learner).

Every stateful part has ``state_dict()`` / ``load_state_dict()``; :meth:`Intake.state_dict`
bundles them for :class:`streamrl.learner.checkpoint_manager.Checkpointer`.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from pathlib import Path

import torch
from tensordict import TensorDict

from streamrl.learner.accounting import Ledger
from streamrl.learner.buffer import StalenessBuffer
from streamrl.learner.control import ControlPlane
from streamrl.learner.journal import Journal
from streamrl.trajectory import concat_trajectories, split_id, split_trajectories

log = logging.getLogger(__name__)
# If no complete batch arrives for this long while no live worker is generating, reservations
# leaked (a worker died holding some and came back before its heartbeat expired): give the
# shortfall back, up to what is held and unaccounted, so live workers can fill it. While a worker
# generates, its batch is on the way: at real lengths one batch takes minutes, and refunding then
# would admit extra batches that arrive too late and are dropped as stale (the first 1k-token GPU
# runs dropped 70 % that way).
REFUND_AFTER_S = 5.0
POLL_S = 0.2
# Ids remembered for duplicate drops. A resend is at most a worker's retention bound old
# (streamrl.transport.retention), so a window far larger than any run's in-flight data is exact.
SEEN_WINDOW = 4_000_000


class SeenIds:
    """Trajectory ids the learner holds durably, oldest forgotten first beyond ``window``."""

    def __init__(self, window: int = SEEN_WINDOW):
        self.window = window
        self.duplicates = 0
        self._ids: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, tid: int) -> bool:
        return tid in self._ids

    def add(self, ids: list[int]) -> None:
        for t in ids:
            self._ids[t] = None
        while len(self._ids) > self.window:
            self._ids.popitem(last=False)

    def keep_new(self, td: TensorDict) -> TensorDict | None:
        """``td`` without the trajectories already seen (None if nothing is new); marks the rest seen."""
        ids = td["traj_id"].tolist()
        keep = [i for i, t in enumerate(ids) if t not in self._ids]
        self.duplicates += len(ids) - len(keep)
        if not keep:
            return None
        self.add([ids[i] for i in keep])
        if len(keep) < len(ids):
            parts = split_trajectories(td)
            td = concat_trajectories([parts[i] for i in keep])
        return td

    def state_dict(self) -> dict:
        return {"ids": torch.tensor(list(self._ids), dtype=torch.int64), "duplicates": self.duplicates}

    def load_state_dict(self, state: dict) -> None:
        self._ids.clear()
        self.add(state["ids"].tolist())
        self.duplicates = int(state.get("duplicates", 0))


class Admission:
    """The learner's half of admission control (the worker's half is ``Coordinator.try_reserve``).

    Workers reserve prompt groups; each version the learner trains ``groups_per_step`` of them.
    With nothing in flight, ``reserved - refunded`` should equal :meth:`accounted_groups`.
    Everything reserved that will never be trained is given back through :meth:`refund`.
    """

    def __init__(self, coord, groups_per_step: int, groups_per_batch: int):
        self.coord = coord
        self.groups_per_step = groups_per_step
        self.groups_per_batch = groups_per_batch  # one worker batch: what a departed worker held
        self.refunded: Counter[str] = Counter()

    def accounted_groups(self, version: int, buffer: StalenessBuffer) -> int:
        """One step's groups per version (skipped versions after a resume included, so a jump does
        not hand out extra capacity) plus the groups waiting in the buffer."""
        return version * self.groups_per_step + buffer.pending_groups()

    def unaccounted_groups(self, accounted_groups: int) -> int:
        """Reservations held but neither trained, buffered (``accounted_groups``) nor refunded: in
        flight, or leaked when no worker is generating. The most any refund may give back: refunding
        more admits batches nobody reserved, and with ``max_staleness`` 0 each of them is generated,
        then dropped as stale, for the rest of the run (e.g. a worker that starts for 20 s without a
        heartbeat would have its learner refund 3 steps' groups and lose half of its samples)."""
        return max(0, self.coord.held_groups() - accounted_groups)

    def refund(self, groups: int, why: str) -> None:
        """Give back ``groups`` reservations (``why``: stale, worker_left, starving)."""
        if groups > 0:
            self.refunded[why] += groups
            self.coord.refund(groups)


class Intake:
    """Receiver, dedup, journal, ledger, staleness buffer, control plane and refunds of rank 0.

    Args:
        cfg: the run config (``learner.groups_per_step``, ``max_staleness``, ``rollout.group_size``).
        coord: the learner's coordinator (Redis control plane).
        source: where trajectory batches come from (``TrajectoryReceiver`` or ``LocalFeed``).
        journal_dir: the checkpoint directory; the journal lives in ``journal_dir/journal``.
        endpoint: the trajectory endpoint advertised to workers.
        starve_timeout_s: stop the run when no complete batch arrives for this long.
    """

    def __init__(self, cfg, coord, source, journal_dir: Path, endpoint: str, starve_timeout_s: float = 600.0):
        self.coord, self.source, self.journal_dir = coord, source, Path(journal_dir)
        self.starve_timeout_s = starve_timeout_s
        self.groups_per_step = cfg.learner.groups_per_step
        self.buffer = StalenessBuffer(cfg.rollout.group_size, cfg.learner.max_staleness)
        self.ledger = Ledger()
        self.seen = SeenIds()
        self.admission = Admission(coord, cfg.learner.groups_per_step, cfg.rollout.prompts_per_batch)
        self.control = ControlPlane(coord, cfg.to_dict(), endpoint, self.ledger, self.admission)
        self.journal: Journal | None = None
        # counters of earlier learner incarnations (the live source's start at 0)
        self._base = {"rejected": Counter(), "rejected_trajectories": 0}

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self, after_step: int, replay: bool) -> None:
        """Start this incarnation's journal segment; on a resume first re-admit what the lost
        incarnation journaled after the checkpoint at ``after_step``."""
        self.journal = Journal(self.journal_dir, after_step)
        if replay:
            self._replay(after_step)

    def start(self, version: int) -> None:
        """Write the learner's control-plane state (after the first publish of ``version``)."""
        self.control.assert_state(version, self.admission.accounted_groups(version, self.buffer))

    def rebase(self, newest_old: int, ancestor: int, new_version: int) -> None:
        """After a resume that skipped versions (see :meth:`StalenessBuffer.rebase`)."""
        self.buffer.rebase(newest_old, ancestor, new_version)

    def on_checkpoint(self, step: int) -> None:
        """A checkpoint at ``step`` completed: the journal drops the segments it covers."""
        self.journal.rotate(step)

    def close(self) -> None:
        self.source.close()

    # -- the loop's one call -----------------------------------------------------------------------
    def next_batch(self, version: int) -> TensorDict | None:
        """``groups_per_step`` complete groups fresh enough for ``version`` (counted as trained),
        or None when the run is stopping (stop key set, or starved for ``starve_timeout_s``)."""
        self.source.max_version = version
        t0 = last_refund = time.monotonic()
        while True:
            self.control.tick(version, self.admission.accounted_groups(version, self.buffer))
            self.admission.refund(self.buffer.drop_stale(version), "stale")
            batch = self.buffer.take(self.groups_per_step, version)
            if batch is not None:
                self.ledger.on_train(batch)
                return batch
            if self.coord.stop_reason() is not None:
                return None
            now = time.monotonic()
            if now - t0 > self.starve_timeout_s:
                log.error("no complete batch for %.0f s; stopping", self.starve_timeout_s)
                self.coord.request_stop("starved")
                return None
            if now - last_refund > REFUND_AFTER_S:
                last_refund = now
                if not self.control.generating():
                    short = min(self.groups_per_step - self.buffer.complete_groups(),
                                self.admission.unaccounted_groups(
                                    self.admission.accounted_groups(version, self.buffer)))
                    if short > 0:
                        log.warning("waited %.0f s for data and no worker is generating; refunding %d group "
                                    "reservations", now - t0, short)
                        self.admission.refund(short, "starving")
            self.receive(POLL_S)

    def receive(self, timeout_s: float) -> int:
        """One poll of the source: admit what arrived, then acknowledge it. Returns batches admitted."""
        n = sum(self._admit(td) is not None for td in self.source.poll(timeout_s))
        self.source.commit()  # everything polled is journaled or dropped for good: workers may forget it
        self.ledger.on_produced(self.source.produced)
        return n

    def _admit(self, td: TensorDict, replay: bool = False) -> TensorDict | None:
        """Dedup, gate, journal, count and buffer one batch; returns what was admitted (or None)."""
        td = self.seen.keep_new(td)
        if td is None:
            return None
        for w in torch.unique(td["worker_id"]).tolist():
            if not replay and not self.control.is_known(int(w)):
                self.ledger.gated["unknown_worker"] += 1
                log.warning("rejected %d trajectories from unregistered worker %d", td["traj_id"].numel(), w)
                return None
        if not replay:
            self.journal.append(td)  # before anything can lose it
        for gid in torch.unique(td["group_id"]).tolist():
            w, inc, _ = split_id(int(gid))
            self.control.note_incarnation(w, inc)
        self.ledger.on_accept(td)
        self.buffer.add(td)
        return td

    def _replay(self, after_step: int) -> None:
        """Re-admit what the lost incarnation accepted after the checkpoint (dedup by trajectory id)."""
        n = 0
        for td in self.journal.replay(after_step):
            for w in torch.unique(td["worker_id"]).tolist():
                self.ledger.known_workers.add(int(w))  # it passed the gate before the crash
            td = self._admit(td, replay=True)
            if td is not None:
                self.journal.append(td)  # the new segment holds it too, until the next checkpoint
                n += int(td["traj_id"].numel())
        self.ledger.replayed += n
        if self.journal.unreadable:
            self.ledger.lost["journal_unreadable_entries"] += self.journal.unreadable
        log.info("journal: replayed %d trajectories accepted after step %d", n, after_step)

    # -- reporting ---------------------------------------------------------------------------------
    def _fold_counters(self) -> None:
        """Fold the live source's counters into the ledger (totals across incarnations)."""
        self.ledger.duplicates_dropped = self.seen.duplicates
        self.ledger.rejected = self._base["rejected"] + Counter(self.source.rejected) + self.ledger.gated
        known = self.ledger.known_workers
        self.ledger.rejected_trajectories = self._base["rejected_trajectories"] + sum(
            n for w, n in self.source.rejected_trajectories.items() if w in known)

    def metrics(self) -> dict[str, float]:
        """``learner/...`` intake metrics of this moment."""
        self._fold_counters()
        b, led = self.buffer, self.ledger
        return {
            "learner/samples_dropped_stale": b.dropped_stale,
            "learner/buffer_trajectories": b.pending_trajectories(),
            # cumulative trained trajectories per version lag (streamrl-monitor's histogram)
            **{f"learner/staleness_hist/{lag}": float(n) for lag, n in b.lag_histogram.items()},
            "learner/accepted": led.accepted,
            "learner/trained_total": led.trained,
            "learner/duplicated": led.duplicated,
            "learner/duplicates_dropped": led.duplicates_dropped,
            "learner/workers_alive": len(self.control.alive()),
            "learner/redis_reasserts": self.control.reasserts,
            **self.source.stats(),
        }

    def accounting(self) -> dict:
        """The ledger's summary (``summary.json["accounting"]``)."""
        self._fold_counters()
        b = self.buffer
        return {**self.ledger.summary(b.pending_trajectories(), b.dropped_stale, b.dropped_overflow),
                "refunded_groups": dict(self.admission.refunded)}

    # -- checkpoint ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON counters plus tensors (``buffer_items``: pending trajectories; ``seen_ids``; ``trained_ids``)."""
        self._fold_counters()
        items, buffer_meta = self.buffer.export_state()
        seen = self.seen.state_dict()
        return {"buffer": buffer_meta, "ledger": self.ledger.state_dict(), "duplicates": seen["duplicates"],
                "refunded": dict(self.admission.refunded),
                "buffer_items": items, "seen_ids": seen["ids"], "trained_ids": self.ledger.trained_ids_tensor()}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state(state.get("buffer_items"), state.get("buffer", {}))
        self.seen.load_state_dict({"ids": state["seen_ids"], "duplicates": state.get("duplicates", 0)})
        trained = state.get("trained_ids")
        self.ledger.load_state_dict(state.get("ledger", {}), trained.tolist() if trained is not None else [])
        self.admission.refunded = Counter(state.get("refunded", {}))
        self._base = {"rejected": Counter(self.ledger.rejected),
                      "rejected_trajectories": self.ledger.rejected_trajectories}
