"""Rollout worker entry point: generate with the newest weights, score, stream to the learner.

The loop never waits for the learner except through admission control: before each batch
the worker reserves capacity in Redis (at most ``max_staleness`` versions ahead of what the
learner accepts). After reserving it loads the newest published weights, so with
``max_staleness=0`` every sample is on-policy (the synchronous baseline).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

import torch

from streamrl.config import config_from_dict
from streamrl.coord.coordinator import Coordinator
from streamrl.engines.hf import HFEngine
from streamrl.metrics import RateLimitedRedisSink
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.tasks import get_task
from streamrl.tasks.registry import problem_stream
from streamrl.trajectory import make_id, pack_trajectories
from streamrl.transport.channel import TrajectorySender
from streamrl.utils import limit_threads, setup_logging
from streamrl.weights.shm import ChecksumError, ShmWeightSubscriber

HEARTBEAT_S = 1.0
# A restarted worker gets a new incarnation; ids carry it so they never repeat.
INCARNATION_BITS = 28


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
        stored = self.coord.get_config()
        if stored is None:
            raise RuntimeError(f"no config in Redis for run {args.run_id}")
        self.cfg = cfg = config_from_dict(stored)
        if args.device:
            cfg.rollout.device = args.device
        self.incarnation = int(self.coord.r.incr(f"streamrl:{args.run_id}:incarnation:{self.wid}"))
        torch.manual_seed(hash((cfg.run.seed, self.wid, self.incarnation)) & 0x7FFFFFFF)
        model, self.tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        self.engine = HFEngine(model, self.tok, cfg.rollout.device)
        self.task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
        self.problems = problem_stream(self.task, cfg.run.seed * 7919 + self.incarnation,
                                       self.wid, max(args.num_workers, self.wid + 1))
        self.subscriber = ShmWeightSubscriber(self.coord)
        self.metrics = RateLimitedRedisSink(self.coord, f"rollout-{self.wid}")
        self.counter = 0
        self.stopping = False
        self.host = socket.gethostname()

    def _next_id(self) -> int:
        self.counter += 1
        return make_id(self.wid, (self.incarnation << INCARNATION_BITS) | self.counter)

    def sync_weights(self) -> float:
        """Load the newest version if there is one; returns seconds spent."""
        v = self.subscriber.newer_version()
        if v is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            tensors = self.subscriber.fetch(v)
        except ChecksumError as e:
            self.log.warning("%s; will re-fetch", e)
            return time.perf_counter() - t0
        if tensors is None:  # superseded while we looked; next round finds the newer one
            return 0.0
        self.engine.load_weights(tensors)
        self.subscriber.mark_loaded(self.wid, v)
        return time.perf_counter() - t0

    def heartbeat(self, state: str) -> None:
        self.coord.heartbeat(self.wid, {
            "host": self.host, "pid": os.getpid(), "device": self.cfg.rollout.device,
            "version": self.subscriber.loaded_version, "state": state, "incarnation": self.incarnation,
        })

    def run(self) -> int:
        cfg = self.cfg
        rc = cfg.rollout
        endpoint = self.coord.wait_endpoint("trajectories")
        sender = TrajectorySender(endpoint, self.wid, hwm=cfg.transport.hwm)
        self.log.info("connected to %s (incarnation %d)", endpoint, self.incarnation)
        last_hb = 0.0
        gen_tokens = trajectories = 0
        wait_s = 0.0
        t_start = time.perf_counter()
        try:
            while not self.stopping and self.coord.stop_reason() is None:
                now = time.monotonic()
                if now - last_hb > HEARTBEAT_S:
                    self.heartbeat("running")
                    last_hb = now
                if not self.coord.try_reserve(rc.prompts_per_batch, cfg.learner.max_staleness,
                                              cfg.learner.groups_per_step):
                    time.sleep(0.02)
                    wait_s += 0.02
                    continue
                load_s = self.sync_weights()
                if self.subscriber.loaded_version < 0:
                    self.coord.refund(rc.prompts_per_batch)
                    time.sleep(0.05)
                    continue
                t_gen = time.perf_counter()
                td = self.rollout_batch()
                gen_s = time.perf_counter() - t_gen
                while not sender.send(td, timeout_s=1.0):  # blocked by backpressure
                    if self.coord.stop_reason() is not None or self.stopping:
                        break
                    self.heartbeat("backpressure")
                n_tok = int(td["response_lens"].sum())
                gen_tokens += n_tok
                trajectories += int(td["reward"].numel())
                elapsed = time.perf_counter() - t_start
                self.metrics.write({
                    "rollout/tokens_per_s_batch": n_tok / max(gen_s, 1e-9),
                    "rollout/generated_tokens": gen_tokens,
                    "rollout/trajectories": trajectories,
                    "rollout/reward_mean": float(td["reward"].mean()),
                    "rollout/version": self.subscriber.loaded_version,
                    "rollout/weights_load_s": load_s,
                    "rollout/admission_wait_s": wait_s,
                    "rollout/tokens_per_s": gen_tokens / max(elapsed, 1e-9),
                })
        finally:
            sender.close()
            self.metrics.close()
        self.log.info("stopping: %s; sent %d trajectories", self.coord.stop_reason() or "signal", trajectories)
        return 0

    def rollout_batch(self):
        """Generate one group per prompt for ``prompts_per_batch`` prompts and score them."""
        rc = self.cfg.rollout
        version = self.subscriber.loaded_version
        problems = [next(self.problems) for _ in range(rc.prompts_per_batch)]
        prompt_ids = [self.tok.encode(p.prompt, add_special_tokens=False) for p in problems]
        flat_prompts = [ids for ids in prompt_ids for _ in range(rc.group_size)]
        gen = self.engine.generate(flat_prompts, rc.max_new_tokens, rc.temperature)
        rewards, group_ids, traj_ids = [], [], []
        for i, problem in enumerate(problems):
            gid = self._next_id()
            for j in range(rc.group_size):
                k = i * rc.group_size + j
                text = self.tok.decode(gen.tokens[k], skip_special_tokens=True)
                rewards.append(float(self.task.reward(problem, text)))
                group_ids.append(gid)
                traj_ids.append(self._next_id())
        versions = [[version] * len(t) for t in gen.tokens]
        return pack_trajectories(flat_prompts, gen.tokens, gen.logprobs, versions, rewards,
                                 group_ids, traj_ids, self.wid, time.time())


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
