"""Learner process entry point (one per rank, started by torchrun / the elastic launcher).

Rank 0 owns the intake (trajectory socket, dedup, journal, staleness buffer, ledger, control
plane: :mod:`streamrl.learner.intake`) and the weights publisher; every rank trains its slice
of each batch under FSDP2. The loop per step:

    rank 0: intake.next_batch(version): G complete, fresh groups (idle time = waiting here)
    all:    broadcast stop-flag + batch → train step → gather full weights → publish version
    rank 0: metrics.jsonl + Redis metrics; checkpoints; at the end summary.json and the stop signal
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.config import config_from_dict, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.core_lending import BUSY, WAITING, make_core_lender, make_learner_phase
from streamrl.learner.checkpoint_manager import Checkpointer, RunProgress
from streamrl.learner.diagnostics import batch_diagnostics, worker_task_rewards
from streamrl.learner.distributed import broadcast_batch, broadcast_flag
from streamrl.learner.intake import Intake
from streamrl.learner.run_checkpoint import checkpoint_dir
from streamrl.learner.staleness_control import StalenessGovernor
from streamrl.learner.trainer import Trainer
from streamrl.learner.warmup import warm_up_pays
from streamrl.metrics import RateLimitedRedisSink, run_sinks
from streamrl.transport.receiver import TrajectoryReceiver
from streamrl.transport.codec import Limits
from streamrl.utils import die_with_parent_if_launched, limit_threads, seed_everything, setup_logging
from streamrl.weights.factory import make_publisher


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="StreamRL learner rank (start through streamrl-launch or torchrun)")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True, help="run id (Redis namespace)")
    p.add_argument("--config", help="YAML config; default: the config stored in Redis by the launcher")
    p.add_argument("--bind-host", default="127.0.0.1", help="address the trajectory socket binds")
    p.add_argument("--advertise-host", default=None, help="address workers connect to (default: bind host)")
    p.add_argument("--starve-timeout", type=float, default=None,
                   help="stop if no complete batch arrives for this long (default: deadlines.data_s)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from a checkpoint directory, or 'latest' under checkpoint.dir (default when no value)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, log, coord, cfg = _setup(args)
    if cfg is None:
        return 2
    trainer = Trainer(cfg)
    # borrow idle colocated workers' cores: per decoder layer (hooks) and between steps
    lender = make_core_lender(cfg, coord, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if lender is not None:
        lender.attach(trainer.model)
    intake = publisher = report = phase = None
    if rank == 0:
        # lend this host's CPU workers the learner's cores while it waits for data (streamrl.core_lending)
        phase = make_learner_phase(cfg, coord, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        intake, publisher = _bind(args, cfg, coord, log)
        report = Reporter(cfg, coord, intake, publisher)
    run = RunProgress()
    ckpt = Checkpointer(cfg, trainer, {"run": run, "intake": intake})
    resumed_step = _resume(args, ckpt, run, intake, coord, log) if args.resume else None
    if rank == 0:
        intake.open(run.step, replay=args.resume is not None)
    publish(trainer, publisher, run.version)
    if rank == 0:
        intake.start(run.version)
    # the workers start their first rollouts now: pay the first step's compiles meanwhile
    warmup_s = _warm_up(trainer, log) if warm_up_pays(cfg) else 0.0
    status, clean = "completed", True
    try:
        while run.step < cfg.run.steps:
            batch, idle = _wait_for_batch(intake, phase, run.version) if rank == 0 else (None, 0.0)
            if broadcast_flag(int(rank == 0 and batch is None)):
                reason = coord.stop_reason()
                # a stop on request (Ctrl-C, the launcher) is a clean exit: every rank exits 0, so
                # torchrun does not kill rank 0 while it writes summary.json; starving is not
                status, clean = "stopped: " + (reason or "starved"), reason is not None
                break
            batch = broadcast_batch(batch)
            t_step = time.perf_counter()
            metrics = _train_step(trainer, lender, batch, run)
            if run.step % cfg.learner.publish_interval == 0 or run.step == cfg.run.steps:
                metrics.update(publish(trainer, publisher, run.version))
            if warmup_s:  # reported with the first step: busy time, not idle (streamrl.learner.warmup)
                metrics["learner/warmup_s"], warmup_s = warmup_s, 0.0
            if rank == 0:
                metrics["learner/checkpoint_failures"] = ckpt.failures  # saves that did not fit on the disk
                report.step(run, batch, metrics, idle, time.perf_counter() - t_step)
            ckpt.maybe_save(run.step)  # after the bookkeeping above, so the saved counters include this step
        ckpt.save_on_stop(run.step)  # clean stop (steps done or stop requested): every rank is here
    except Exception:
        status, clean = "failed", False
        raise
    finally:
        if lender is not None:
            lender.close()
        if phase is not None:
            phase.close()
        if rank == 0:
            report.finish(run, status, resumed_step)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if clean else 1


def _wait_for_batch(intake: Intake, phase, version: int) -> tuple:
    """Rank 0: the next batch (None when the run stops or starves) and the seconds waited for
    it, with the learner's phase ``waiting`` meanwhile (colocated workers borrow its cores)."""
    t_wait = time.perf_counter()
    if phase is not None:
        phase.set(WAITING)
    batch = intake.next_batch(version)
    if phase is not None:
        phase.set(BUSY)
    return batch, time.perf_counter() - t_wait


def _train_step(trainer: Trainer, lender, batch, run: RunProgress) -> dict[str, float]:
    """One trainer step (with the idle workers' cores lent for it), counted in ``run``; its metrics."""
    if lender is not None:
        lender.apply()
    metrics = trainer.step(batch)
    run.version += 1
    run.step += 1
    if lender is not None:
        lender.apply()
        metrics.update(lender.metrics())
    return metrics


def _warm_up(trainer: Trainer, log) -> float:
    """:meth:`Trainer.warm_up`, timed; returns its seconds."""
    t0 = time.perf_counter()
    trainer.warm_up()
    took = time.perf_counter() - t0
    log.info("warm-up (first-step compiles and allocations, no update) took %.1f s", took)
    return took


def _setup(args):
    """Process-level setup: parent watch, threads, process group, logging, Redis, config, seed."""
    # a torchrun rank is in a session of its own: go when the agent goes. SIGKILL, not SIGTERM:
    # the launcher restarts the job from the checkpoint + journal, and a rank still writing a
    # checkpoint then would race the new learner reading it
    die_with_parent_if_launched(signal.SIGKILL)
    limit_threads()
    rank = int(os.environ.get("RANK", "0"))
    log = setup_logging(f"learner[{rank}]")
    coord = Coordinator(args.redis_url, args.run_id)
    if args.config:
        cfg = load_config(args.config, args.overrides)
    else:
        stored = coord.get_config()
        if stored is None:
            log.error("no config in Redis for run %s and no --config given", args.run_id)
            return rank, log, coord, None
        cfg = config_from_dict(stored)
    coord.set_outage_s(cfg.deadlines.redis_outage_s)
    if "RANK" in os.environ and not dist.is_initialized():  # after the config: its collective deadline
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("STREAMRL_BACKEND") != "gloo" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.deadlines.collective_s))
    if cfg.learner.device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    seed_everything(cfg.run.seed)
    return rank, log, coord, cfg


def _bind(args, cfg, coord, log):
    """Rank 0: the trajectory socket (advertised in Redis), the intake over it, the weights publisher."""
    Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
    advertise = args.advertise_host or (socket.gethostname() if args.bind_host == "0.0.0.0" else args.bind_host)
    receiver = _bind_receiver(args, cfg, Limits(max_message_bytes=cfg.transport.max_message_bytes),
                              coord if args.resume else None, log)
    endpoint = f"tcp://{advertise}:{receiver.endpoint.rsplit(':', 1)[1]}"
    coord.set_endpoint("trajectories", endpoint)
    intake = Intake(cfg, coord, receiver, checkpoint_dir(cfg), endpoint,
                    args.starve_timeout if args.starve_timeout is not None else cfg.deadlines.data_s)
    # Data plane from cfg.weights (auto: shm for this host's workers, ZeroMQ for other hosts).
    publisher = make_publisher(coord, args.run_id, cfg, bind_host=args.bind_host, advertise_host=advertise)
    log.info("trajectory endpoint %s", endpoint)
    return intake, publisher


def _resume(args, ckpt, run, intake, coord, log) -> int:
    """Restore the checkpoint (if any) and move the version past what the lost incarnation
    published (versions never go back). Collective. Returns the step resumed from."""
    path = ckpt.find(args.resume)
    if path is None:  # crashed before the first checkpoint: start over, replay the journal
        log.warning("--resume: no complete checkpoint under %s; starting at step 0 (journal replayed)", ckpt.root)
    else:
        ckpt.restore(path)
        log.info("resumed from %s at step %d, version %d", path, run.step, run.version)
    newest_old = broadcast_flag(coord.pending_version() if intake is not None else -1)
    if newest_old >= run.version:
        if intake is not None:
            intake.rebase(newest_old, run.version, newest_old + 1)
        log.info("versions up to v%d were published before the restart; continuing at v%d", newest_old,
                 newest_old + 1)
        run.version = newest_old + 1
    return run.step


def publish(trainer, publisher, version: int) -> dict[str, float]:
    """Gather full weights (collective) and, on rank 0, publish them as ``version``. The
    announcement runs in the background (on the ipc plane the copies too, queued before the next
    step's updates on the GPU): the learner goes on with its next step meanwhile."""
    tensors = trainer.full_tensors()
    if publisher is not None:
        return publisher.publish(version, trainer.param_specs, tensors, background=True)
    for _ in tensors:  # join the gathers; only rank 0 keeps the tensors
        pass
    return {}


class Reporter:
    """Rank 0's metrics (metrics.jsonl, TensorBoard, Redis), log lines and summary.json."""

    def __init__(self, cfg, coord, intake: Intake, publisher):
        self.cfg, self.coord, self.intake, self.publisher = cfg, coord, intake, publisher
        self.run_dir = Path(cfg.run.run_dir)
        self.sink = run_sinks(cfg, self.run_dir)
        self.redis_sink = RateLimitedRedisSink(coord, "learner")
        self.t_start = time.time()
        self.idle_total = 0.0
        self.staleness = StalenessGovernor(cfg.learner, coord)

    def step(self, run: RunProgress, batch, metrics: dict, idle: float, step_s: float) -> None:
        self.idle_total += idle
        run.samples += int(metrics["learner/trajectories"])
        run.rewards.append(metrics["learner/reward_mean"])
        metrics.update({
            "learner/step": run.step, "learner/version": run.version, "learner/samples": run.samples,
            "learner/step_s": step_s, "learner/idle_s": idle, "learner/idle_frac": idle / max(idle + step_s, 1e-9),
            **batch_diagnostics(batch, run.version - 1,
                                None if self.cfg.env.name != "none" else self.cfg.rollout.max_new_tokens),
            **worker_task_rewards(self.coord.latest_metrics()),
            "time": time.time(), "wall_s": time.time() - self.t_start,
            **self.intake.metrics(),
            # served bytes, versions kept for readers holding a lease (streamrl-monitor)
            **self.publisher.stats(),
        })
        metrics.update(self.staleness.step(metrics))  # after idle_frac: a signal of the controller
        self.sink.write(metrics)
        self.redis_sink.write(metrics)
        if run.step % 10 == 0 or run.step == self.cfg.run.steps:
            logging.getLogger("learner").info(
                "step %d v%d reward %.3f samples %d idle %.0f%%", run.step, run.version,
                metrics["learner/reward_mean"], run.samples, 100 * metrics["learner/idle_frac"])

    def finish(self, run: RunProgress, status: str, resumed_step: int | None) -> None:
        wall = time.time() - self.t_start
        summary = _summary(run, wall, self.intake, self.idle_total, status)
        summary["resumed_from_step"] = resumed_step
        from streamrl.evaluate import read_eval_summary  # here: evaluate pulls in the rollout worker's modules

        summary["eval"] = read_eval_summary(self.run_dir)  # the evaluator role's eval.json, if it ran
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if status != "failed":
            # A crashed learner does not end the run: the launcher decides (restart with
            # --resume, or stop everything), so workers must not see a stop key now.
            self.coord.request_stop(status)
        self.redis_sink.close()
        self.sink.close()
        self.intake.close()
        self.publisher.close()
        logging.getLogger("learner").info("summary: %s", json.dumps(summary))


def _bind_receiver(args, cfg, limits, coord, log):
    """Bind the trajectory socket; on a resume, on the previous port if free, so workers that kept
    running reconnect by themselves and resend what the lost incarnation never made durable."""
    if coord is not None:
        old = coord.get_endpoint("trajectories")
        if old:
            try:
                return TrajectoryReceiver(f"tcp://{args.bind_host}:{old.rsplit(':', 1)[1]}", hwm=cfg.transport.hwm,
                                          limits=limits)
            except Exception as e:  # zmq.ZMQError (port taken): workers will be restarted by the launcher
                log.warning("could not re-bind the previous trajectory port (%s); binding a new one", e)
    return TrajectoryReceiver(f"tcp://{args.bind_host}:*", hwm=cfg.transport.hwm, limits=limits)


def _summary(run: RunProgress, wall: float, intake: Intake, idle_total: float, status: str) -> dict:
    k = max(1, len(run.rewards) // 10)
    buffer = intake.buffer
    return {
        "status": status,
        "steps": run.step,
        "samples": run.samples,
        "wall_s": wall,
        "samples_per_s": run.samples / wall if wall > 0 else 0.0,
        "reward_first": sum(run.rewards[:k]) / k if run.rewards else None,
        "reward_last": sum(run.rewards[-k:]) / k if run.rewards else None,
        "versions_published": run.version + 1,
        "final_version": run.version,
        "samples_dropped_stale": buffer.dropped_stale,
        "learner_idle_s": idle_total,
        "staleness_histogram": {str(k): v for k, v in sorted(buffer.lag_histogram.items())},
        "transport": intake.source.stats(),
        "accounting": intake.accounting(),
        "redis_reasserts": intake.control.reasserts,
    }


if __name__ == "__main__":
    sys.exit(main())
