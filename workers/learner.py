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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.config import config_from_dict, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.learner.buffer import StalenessBuffer
from streamrl.learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from streamrl.learner.distributed import broadcast_batch, broadcast_flag
from streamrl.learner.trainer import Trainer
from streamrl.metrics import JsonlSink, RateLimitedRedisSink
from streamrl.transport.channel import TrajectoryReceiver
from streamrl.transport.codec import Limits
from streamrl.utils import limit_threads, seed_everything, setup_logging
from streamrl.weights.shm import ShmWeightPublisher

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

    receiver = publisher = sink = redis_sink = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        limits = Limits(max_message_bytes=cfg.transport.max_message_bytes)
        receiver = TrajectoryReceiver(f"tcp://{args.bind_host}:*", hwm=cfg.transport.hwm, limits=limits)
        port = receiver.endpoint.rsplit(":", 1)[1]
        advertise = args.advertise_host or (socket.gethostname() if args.bind_host == "0.0.0.0" else args.bind_host)
        coord.set_endpoint("trajectories", f"tcp://{advertise}:{port}")
        publisher = ShmWeightPublisher(coord, args.run_id)
        sink = JsonlSink(run_dir / "metrics.jsonl")
        redis_sink = RateLimitedRedisSink(coord, "learner")
        log.info("trajectory endpoint %s; %d ranks", coord.r.get(coord.keys.endpoint("trajectories")), trainer.world)

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
    if args.resume:
        path = latest_checkpoint(ck_root) if args.resume == "latest" else Path(args.resume)
        if path is None:
            log.error("--resume: no complete checkpoint under %s", ck_root)
            return 2
        state, items, seen = load_checkpoint(path, trainer)
        step, version = int(state["step"]), int(state.get("version", state["step"]))
        samples, rewards = int(state.get("samples", 0)), list(state.get("rewards", []))
        if rank == 0:
            buffer.load_state(items, state.get("buffer", {}))
            receiver.mark_seen(seen)
        log.info("resumed from %s at step %d, version %d", path, step, version)

    def checkpoint() -> None:
        items, bmeta = buffer.export_state() if rank == 0 else (None, {})
        # The receiver's dedup window (private in the channel; read-only here).
        seen = list(getattr(receiver, "_seen", {}).keys()) if rank == 0 else []
        save_checkpoint(ck_root, step, trainer, {"version": version, "samples": samples, "rewards": rewards,
                                                 "buffer": bmeta}, items, seen, cfg.checkpoint.keep_last)

    publish(version)
    try:
        while step < cfg.run.steps:
            t_wait = time.perf_counter()
            batch = None
            stop = 0
            if rank == 0:
                batch, stop = _collect(receiver, buffer, coord, lc, version, args.starve_timeout, log)
            idle = time.perf_counter() - t_wait
            if broadcast_flag(stop):
                status = "stopped: " + (coord.stop_reason() or "starved")
                break
            batch = broadcast_batch(batch)
            t_step = time.perf_counter()
            metrics = trainer.step(batch)
            version += 1
            step += 1
            if step % lc.publish_interval == 0 or step == cfg.run.steps:
                metrics.update(publish(version))
            if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
                checkpoint()
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
                    "time": time.time(),
                    "wall_s": time.time() - t_start,
                    **receiver.stats(),
                })
                sink.write(metrics)
                redis_sink.write(metrics)
                if step % 10 == 0 or step == cfg.run.steps:
                    log.info("step %d v%d reward %.3f samples %d idle %.0f%%", step, version,
                             metrics["learner/reward_mean"], samples, 100 * metrics["learner/idle_frac"])
        if cfg.checkpoint.save_on_stop and step > 0 and not (
                cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0):
            checkpoint()  # clean stop (steps done or stop requested): every rank is here
    except Exception:
        status = "failed"
        raise
    finally:
        if rank == 0:
            wall = time.time() - t_start
            summary = _summary(step, samples, wall, rewards, version, buffer, idle_total, receiver, status)
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            coord.request_stop(status)
            redis_sink.close()
            sink.close()
            receiver.close()
            publisher.close()
            log.info("summary: %s", json.dumps(summary))
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if status == "completed" else 1


def _collect(receiver, buffer, coord, lc, version, starve_timeout, log):
    """Receive until ``groups_per_step`` complete, fresh groups are ready. Returns (batch, stop)."""
    receiver.max_version = version
    t0 = last_refund = time.monotonic()
    while True:
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
            buffer.add(td)


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
