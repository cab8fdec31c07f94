"""Learner process entry point (one per rank, started by torchrun / the elastic launcher).

Rank 0 owns the trajectory socket, the staleness buffer and the weights publisher; every
rank trains its slice of each batch under FSDP2. The loop per step:

    rank 0: receive until G complete, fresh groups are buffered (idle time = waiting here)
    all:    broadcast stop-flag + batch → train step → gather full weights → publish version
    rank 0: metrics.jsonl + Redis metrics; at the end summary.json and the stop signal
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.config import config_from_dict, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.accounting import Ledger, split_id
from streamrl.learner.buffer import StalenessBuffer
from streamrl.learner.checkpoint import (checkpoint_dir, latest_checkpoint, load_checkpoint, load_extra,
                                         save_checkpoint)
from streamrl.learner.control import ControlPlane
from streamrl.learner.journal import Journal
from streamrl.learner.distributed import broadcast_batch, broadcast_flag
from streamrl.learner.trainer import Trainer
from streamrl.metrics import JsonlSink, MultiSink, RateLimitedRedisSink, tensorboard_sink
from streamrl.transport.channel import TrajectoryReceiver
from streamrl.transport.codec import Limits
from streamrl.trajectory import concat_trajectories, split_trajectories
from streamrl.utils import die_with_parent_if_launched, limit_threads, seed_everything, setup_logging
from streamrl.weights.factory import make_publisher

# If no complete batch arrives for this long, assume reservations of dead workers leaked
# and give the shortfall back so live workers can fill it (the buffer still enforces staleness).
REFUND_AFTER_S = 5.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="StreamRL learner rank (start through streamrl-launch or torchrun)")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True, help="run id (Redis namespace)")
    p.add_argument("--config", help="YAML config; default: the config stored in Redis by the launcher")
    p.add_argument("--bind-host", default="127.0.0.1", help="address the trajectory socket binds")
    p.add_argument("--advertise-host", default=None, help="address workers connect to (default: bind host)")
    p.add_argument("--starve-timeout", type=float, default=600.0, help="fail if no data arrives for this long")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from a checkpoint directory, or 'latest' under checkpoint.dir (default when no value)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # a torchrun rank is in a session of its own: go when the agent goes. SIGKILL, not SIGTERM:
    # the launcher restarts the job from the checkpoint + journal, and a rank still writing a
    # checkpoint then would race the new learner reading it
    die_with_parent_if_launched(signal.SIGKILL)
    limit_threads()
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("STREAMRL_BACKEND") != "gloo" else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    log = setup_logging(f"learner[{rank}]")
    coord = Coordinator(args.redis_url, args.run_id)
    if args.config:
        cfg = load_config(args.config, args.overrides)
    else:
        stored = coord.get_config()
        if stored is None:
            log.error("no config in Redis for run %s and no --config given", args.run_id)
            return 2
        cfg = config_from_dict(stored)
    if cfg.learner.device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    seed_everything(cfg.run.seed)
    run_dir = Path(cfg.run.run_dir)
    trainer = Trainer(cfg)
    lc = cfg.learner

    receiver = publisher = sink = redis_sink = control = journal = None
    ledger = Ledger(cfg.rollout.group_size)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        limits = Limits(max_message_bytes=cfg.transport.max_message_bytes)
        advertise = args.advertise_host or (socket.gethostname() if args.bind_host == "0.0.0.0" else args.bind_host)
        receiver = _bind_receiver(args, cfg, limits, coord if args.resume else None, log)
        port = receiver.endpoint.rsplit(":", 1)[1]
        endpoint = f"tcp://{advertise}:{port}"
        coord.set_endpoint("trajectories", endpoint)
        # Data plane from cfg.weights (auto: shm for this host's workers, ZeroMQ for other hosts).
        publisher = make_publisher(coord, args.run_id, cfg, bind_host=args.bind_host, advertise_host=advertise)
        sink = MultiSink(JsonlSink(run_dir / "metrics.jsonl"), tensorboard_sink(run_dir / "tb"))
        redis_sink = RateLimitedRedisSink(coord, "learner")
        control = ControlPlane(coord, cfg.to_dict(), endpoint, ledger, cfg.rollout.prompts_per_batch)
        log.info("trajectory endpoint %s; %d ranks", endpoint, trainer.world)

    def publish(version: int) -> dict[str, float]:
        tensors = trainer.full_tensors()
        if rank == 0:
            return publisher.publish(version, trainer.param_specs, tensors)
        for _ in tensors:  # join the gathers; only rank 0 keeps the tensors
            pass
        return {}

    version = 0
    buffer = StalenessBuffer(cfg.rollout.group_size, lc.max_staleness)
    t_start = time.time()
    rewards: list[float] = []
    samples = 0
    idle_total = 0.0
    step = 0
    status = "completed"
    ck_root = checkpoint_dir(cfg)
    base = {"duplicates": 0, "rejected": {}}  # receiver counters of earlier incarnations
    if args.resume:
        path = latest_checkpoint(ck_root) if args.resume == "latest" else Path(args.resume)
        if path is None:  # crashed before the first checkpoint: start over, replay the journal
            log.warning("--resume: no complete checkpoint under %s; starting at step 0 (journal replayed)", ck_root)
        else:
            state, items, seen = load_checkpoint(path, trainer)
            step, version = int(state["step"]), int(state.get("version", state["step"]))
            samples, rewards = int(state.get("samples", 0)), list(state.get("rewards", []))
            if rank == 0:
                buffer.load_state(items, state.get("buffer", {}))
                receiver.mark_seen(seen)
                ids = load_extra(path).get("trained_ids")
                ledger.load_state_dict(state.get("ledger", {}), ids.tolist() if ids is not None else [])
                base = {"duplicates": ledger.duplicates_dropped, "rejected": dict(ledger.rejected)}
            log.info("resumed from %s at step %d, version %d", path, step, version)
        # Versions never go back: continue above anything the lost incarnation published.
        newest_old = coord.pending_version() if rank == 0 else -1
        newest_old = broadcast_flag(newest_old)
        if newest_old >= version:
            if rank == 0:
                buffer.rebase(newest_old, version, newest_old + 1)
            log.info("versions up to v%d were published before the restart; continuing at v%d", newest_old,
                     newest_old + 1)
            version = newest_old + 1
    resumed_step = step
    if rank == 0:
        journal = Journal(ck_root, resumed_step)
        if args.resume:
            _replay(journal, resumed_step, receiver, buffer, ledger, control, log)

    def report_counters() -> None:
        """Fold the live receiver's counters into the ledger (totals across incarnations)."""
        ledger.duplicates_dropped = base["duplicates"] + receiver.duplicates
        ledger.rejected = Counter(base["rejected"]) + Counter(receiver.rejected) + ledger.gated

    def checkpoint() -> None:
        items, bmeta = buffer.export_state() if rank == 0 else (None, {})
        # The receiver's dedup window (private in the channel; read-only here).
        seen = list(getattr(receiver, "_seen", {}).keys()) if rank == 0 else []
        extra = None
        if rank == 0:
            report_counters()
            extra = {"trained_ids": ledger.trained_ids_tensor()}
        save_checkpoint(ck_root, step, trainer, {"version": version, "samples": samples, "rewards": rewards,
                                                 "buffer": bmeta, "ledger": ledger.state_dict() if rank == 0 else {}},
                        items, seen, cfg.checkpoint.keep_last, extra_tensors=extra)
        if rank == 0:
            journal.rotate(step)

    publish(version)
    if rank == 0:
        control.assert_state(version, _accounted_groups(version, buffer, cfg))
    try:
        while step < cfg.run.steps:
            t_wait = time.perf_counter()
            batch = None
            stop = 0
            if rank == 0:
                batch, stop = _collect(receiver, buffer, coord, lc, version, args.starve_timeout, log,
                                       ledger, control, journal, cfg)
            idle = time.perf_counter() - t_wait
            if broadcast_flag(stop):
                status = "stopped: " + (coord.stop_reason() or "starved")
                break
            batch = broadcast_batch(batch)
            if rank == 0:
                ledger.on_train(batch)
            t_step = time.perf_counter()
            metrics = trainer.step(batch)
            version += 1
            step += 1
            if step % lc.publish_interval == 0 or step == cfg.run.steps:
                metrics.update(publish(version))
            if rank == 0:
                control.tick(version, _accounted_groups(version, buffer, cfg))
            step_s = time.perf_counter() - t_step
            if rank == 0:
                idle_total += idle
                samples += int(metrics["learner/trajectories"])
                rewards.append(metrics["learner/reward_mean"])
                lags = batch_lags(batch, version - 1)
                metrics.update({
                    "learner/step": step,
                    "learner/version": version,
                    "learner/samples": samples,
                    "learner/step_s": step_s,
                    "learner/idle_s": idle,
                    "learner/idle_frac": idle / max(idle + step_s, 1e-9),
                    "learner/staleness_mean": lags,
                    "learner/samples_dropped_stale": buffer.dropped_stale,
                    "learner/buffer_trajectories": buffer.pending_trajectories(),
                    # cumulative trained trajectories per version lag (streamrl-monitor's histogram)
                    **{f"learner/staleness_hist/{lag}": float(n) for lag, n in buffer.lag_histogram.items()},
                    "learner/accepted": ledger.accepted,
                    "learner/trained_total": ledger.trained,
                    "learner/duplicated": ledger.duplicated,
                    "learner/workers_alive": len(control.alive()),
                    "learner/redis_reasserts": control.reasserts,
                    "time": time.time(),
                    "wall_s": time.time() - t_start,
                    **receiver.stats(),
                    # served bytes, versions kept for readers holding a lease (streamrl-monitor)
                    **(publisher.stats() if publisher is not None else {}),
                })
                sink.write(metrics)
                redis_sink.write(metrics)
                if step % 10 == 0 or step == cfg.run.steps:
                    log.info("step %d v%d reward %.3f samples %d idle %.0f%%", step, version,
                             metrics["learner/reward_mean"], samples, 100 * metrics["learner/idle_frac"])
            if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
                checkpoint()  # after the bookkeeping above, so the saved counters include this step
        if cfg.checkpoint.save_on_stop and step > 0 and not (
                cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0):
            checkpoint()  # clean stop (steps done or stop requested): every rank is here
    except Exception:
        status = "failed"
        raise
    finally:
        if rank == 0:
            wall = time.time() - t_start
            report_counters()
            summary = _summary(step, samples, wall, rewards, version, buffer, idle_total, receiver, status)
            summary["accounting"] = ledger.summary(buffer.pending_trajectories(), buffer.dropped_stale,
                                                   buffer.dropped_overflow)
            summary["resumed_from_step"] = resumed_step if args.resume else None
            summary["final_version"] = version
            summary["redis_reasserts"] = control.reasserts
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if status != "failed":
                # A crashed learner does not end the run: the launcher decides (restart with
                # --resume, or stop everything), so workers must not see a stop key now.
                coord.request_stop(status)
            redis_sink.close()
            sink.close()
            receiver.close()
            publisher.close()
            log.info("summary: %s", json.dumps(summary))
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if status == "completed" else 1


def _collect(receiver, buffer, coord, lc, version, starve_timeout, log, ledger, control, journal, cfg):
    """Receive until ``groups_per_step`` complete, fresh groups are ready. Returns (batch, stop)."""
    receiver.max_version = version
    t0 = last_refund = time.monotonic()
    while True:
        control.tick(version, _accounted_groups(version, buffer, cfg))
        dropped = buffer.drop_stale(version)
        if dropped:
            coord.refund(dropped)
        batch = buffer.take(lc.groups_per_step, version)
        if batch is not None:
            return batch, 0
        if coord.stop_reason() is not None:
            return None, 1
        now = time.monotonic()
        if now - t0 > starve_timeout:
            log.error("no complete batch for %.0f s; stopping", starve_timeout)
            coord.request_stop("starved")
            return None, 1
        if now - last_refund > REFUND_AFTER_S:
            short = lc.groups_per_step - buffer.complete_groups()
            log.warning("waited %.0f s for data; refunding %d group reservations", now - t0, short)
            coord.refund(short)
            last_refund = now
        for td in receiver.poll(0.2):
            _admit(td, buffer, ledger, control, journal, log)


def _admit(td, buffer, ledger, control, journal, log, replay: bool = False) -> bool:
    """Learner-level gates after the transport's: a registered worker; then journal, count, buffer."""
    for w in torch.unique(td["worker_id"]).tolist():
        if not control.is_known(int(w)):
            ledger.gated["unknown_worker"] += 1
            log.warning("rejected %d trajectories from unregistered worker %d", td["traj_id"].numel(), w)
            return False
    if not replay:
        journal.append(td)  # before anything can lose it
    for gid in torch.unique(td["group_id"]).tolist():
        w, inc, _ = split_id(int(gid))
        control.note_incarnation(w, inc)
    ledger.on_accept(td)
    buffer.add(td)
    return True


def _replay(journal, after_step, receiver, buffer, ledger, control, log) -> None:
    """Re-admit what the lost incarnation accepted after the checkpoint (dedup by trajectory id)."""
    n = 0
    seen = getattr(receiver, "_seen", {})  # the receiver's dedup window (mark_seen below extends it)
    for td in journal.replay(after_step):
        ids = td["traj_id"].tolist()
        keep = [i for i, t in enumerate(ids) if t not in seen]
        if not keep:
            continue
        if len(keep) < len(ids):
            parts = split_trajectories(td)
            td = concat_trajectories([parts[i] for i in keep])
        receiver.mark_seen([ids[i] for i in keep])
        for w in torch.unique(td["worker_id"]).tolist():
            ledger.known_workers.add(int(w))
        if _admit(td, buffer, ledger, control, journal, log, replay=True):
            ledger.replayed += len(keep)
            journal.append(td)  # the new segment holds it too, until the next checkpoint
            n += len(keep)
    if journal.unreadable:
        ledger.lost["journal_unreadable_entries"] += journal.unreadable
    log.info("journal: replayed %d trajectories accepted after step %d", n, after_step)


def _accounted_groups(version, buffer, cfg) -> int:
    """What admission control's ``reserved - refunded`` should be with nothing in flight: one
    step's groups per version (skipped versions after a resume included, so a jump does not
    hand out extra capacity) plus the groups waiting in the buffer."""
    return version * cfg.learner.groups_per_step + buffer.pending_groups()


def _bind_receiver(args, cfg, limits, coord, log):
    """Bind the trajectory socket; on a resume, on the previous port if free, so workers that kept
    running reconnect by themselves and deliver what they queued during the outage."""
    if coord is not None:
        old = coord.get_endpoint("trajectories")
        if old:
            try:
                return TrajectoryReceiver(f"tcp://{args.bind_host}:{old.rsplit(':', 1)[1]}", hwm=cfg.transport.hwm,
                                          limits=limits)
            except Exception as e:  # zmq.ZMQError (port taken): workers will be restarted by the launcher
                log.warning("could not re-bind the previous trajectory port (%s); binding a new one", e)
    return TrajectoryReceiver(f"tcp://{args.bind_host}:*", hwm=cfg.transport.hwm, limits=limits)


def batch_lags(batch, version: int) -> float:
    """Mean version lag of the batch's tokens at training time."""
    v = batch["policy_version"].float()
    return float((version - v).mean()) if v.numel() else 0.0


def _summary(step, samples, wall, rewards, version, buffer, idle_total, receiver, status) -> dict:
    k = max(1, len(rewards) // 10)
    return {
        "status": status,
        "steps": step,
        "samples": samples,
        "wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "reward_first": sum(rewards[:k]) / k if rewards else None,
        "reward_last": sum(rewards[-k:]) / k if rewards else None,
        "versions_published": version + 1,
        "samples_dropped_stale": buffer.dropped_stale,
        "learner_idle_s": idle_total,
        "staleness_histogram": {str(k): v for k, v in sorted(buffer.lag_histogram.items())},
        "transport": receiver.stats(),
    }


if __name__ == "__main__":
    sys.exit(main())
