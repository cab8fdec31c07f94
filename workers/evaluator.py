"""Evaluator process: held-out accuracy of the published policy while the run trains.

Started by ``streamrl-launch`` when ``eval.interval > 0`` (supervised like a rollout worker).
It subscribes to the learner's weights the way a rollout worker does (through the public
:class:`~streamrl.weights.subscriber.WeightSubscriber` API) but never generates training data
and never acks a version (it is no rollout worker: admission control and weight acks do not
count it). It evaluates version 0 (the untrained policy), then the newest version each time
the learner has moved into a new ``eval.interval`` block (0, 10, 20, ... with interval 10;
a version it was too busy to see is skipped, the newer one is evaluated instead).

Each evaluation (see :func:`streamrl.evaluate.evaluate`) is written

* to ``RUN_DIR/metrics.jsonl`` as one line ``{"eval/version", "eval/accuracy", ...,
  "time"}``, with a single ``write`` on an ``O_APPEND`` descriptor so it never interleaves
  with the learner's lines in the same file;
* to Redis metrics (process ``eval``) for ``streamrl-monitor``, and to TensorBoard
  (``RUN_DIR/tb``, step = version);
* to ``RUN_DIR/eval.json``: ``{"latest": row, "best": row, "evaluations": n}`` (replaced
  atomically), which the run summary merges (:func:`streamrl.evaluate.read_eval_summary`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from streamrl.config import config_from_dict
from streamrl.coord.coordinator import Coordinator
from streamrl.evaluate import EVAL_FILE, eval_decoder, eval_set, evaluate_config
from streamrl.metrics import MultiSink, RateLimitedRedisSink, tensorboard_sink
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.tasks import build_task
from streamrl.utils import limit_threads, setup_logging
from streamrl.weights.factory import make_subscriber
from streamrl.weights.layout import ChecksumError

POLL_S = 0.2  # how often Redis is asked for a newer version while idle


def append_line(path: Path, row: dict) -> None:
    """Append one JSON line with one ``write`` on an O_APPEND descriptor (no interleaving with
    other appenders of the same file, such as the learner's metrics sink)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


class Evaluator:
    def __init__(self, args):
        self.log = setup_logging("evaluator")
        self.coord = Coordinator(args.redis_url, args.run_id)
        self.cfg = cfg = config_from_dict(self.coord.wait_config())
        if cfg.weights.target != "hf":  # the evaluator's model is a transformers model
            raise ValueError(f"eval.interval = {cfg.eval.interval} needs weights.target = 'hf' (transformers names), "
                             f"not {cfg.weights.target!r}")
        device = args.device or cfg.eval.device
        model, self.tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        # evaluate() generates with the decoder, and each published version is copied into it in place
        self.decoder = eval_decoder(cfg, model.to(device), self.tok)
        self.task = build_task(cfg.task)
        self.problems = eval_set(cfg, self.task)
        self.subscriber = make_subscriber(self.coord, cfg, device=device)
        self.run_dir = Path(cfg.run.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # TensorBoard: a second event file in the learner's tb/ folder, eval/* scalars at step = version
        self.metrics = MultiSink(RateLimitedRedisSink(self.coord, "eval"),
                                 tensorboard_sink(self.run_dir / "tb", step_key="eval/version"))
        self.interval = max(cfg.eval.interval, 1)
        self.last: int | None = None
        self.best: dict | None = None
        self.count = 0
        self.stopping = False
        self.busy = False

    def due(self, version: int) -> bool:
        """Version 0 first, then the newest version of every new ``interval`` block."""
        return version >= 0 and (self.last is None or version // self.interval > self.last // self.interval)

    def evaluate_version(self, version: int) -> dict | None:
        """Load ``version``, evaluate it, write the row everywhere; None when it is gone."""
        try:
            tensors = self.subscriber.fetch(version)
        except ChecksumError as e:
            self.log.warning("%s; will re-fetch", e)
            return None
        if tensors is None:  # garbage-collected or superseded while we looked: take the next one
            return None
        self.decoder.load_weights(tensors)
        del tensors  # free the views (and the store's read lease) before the long evaluation
        t0 = time.perf_counter()
        self.busy = True
        try:
            res = evaluate_config(self.decoder, self.tok, self.cfg, self.task, self.problems)
        finally:
            self.busy = False
        row = {"eval/version": version, **res, "eval/seconds": time.perf_counter() - t0, "time": time.time()}
        self.last = version
        self.count += 1
        if self.best is None or row["eval/accuracy"] > self.best["eval/accuracy"]:
            self.best = row
        append_line(self.run_dir / "metrics.jsonl", row)
        self.metrics.write(row)
        write_json_atomic(self.run_dir / EVAL_FILE, {"latest": row, "best": self.best, "evaluations": self.count})
        self.log.info("version %d: accuracy %.3f (n %d, %.0f s)", version, row["eval/accuracy"], row["eval/n"],
                      row["eval/seconds"])
        return row

    def run(self) -> int:
        self.log.info("evaluating %d held-out problems every %d versions", len(self.problems), self.interval)
        try:
            while not self.stopping and self.coord.stop_reason() is None:
                v = self.subscriber.current()
                if self.due(v):
                    self.evaluate_version(v)
                else:
                    time.sleep(POLL_S)
        finally:
            self.metrics.close()
            self.subscriber.close()
        self.log.info("stopping: %s; %d evaluations", self.coord.stop_reason() or "signal", self.count)
        return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="StreamRL evaluator (held-out accuracy during training)")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True, help="run id (Redis namespace)")
    p.add_argument("--device", default=None, help="model device, overriding eval.device")
    return p.parse_args(argv)


def main(argv=None) -> int:
    limit_threads()
    torch.set_grad_enabled(False)
    ev = Evaluator(parse_args(argv))

    def on_signal(signum, frame):
        ev.stopping = True
        if ev.busy:  # an evaluation can take minutes: leave now rather than be killed mid-way
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return ev.run()


if __name__ == "__main__":
    sys.exit(main())
