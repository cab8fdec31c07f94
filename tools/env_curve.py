"""Sample a live multi-turn run's learning curve: learner step and reward, and the rollout
workers' tool-call rate, turns and tool errors (the ``env/...`` metrics), every few seconds.

    streamrl-launch --config configs/tiny-tools.yaml &
    python tools/env_curve.py runs/tiny-tools --every 15 > curve.jsonl

Reads Redis through the run's ``run.json`` (written by streamrl-launch); prints one JSON line
per sample and exits once the run's Redis is gone (the run ended).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from streamrl.coord.coordinator import Coordinator
from streamrl.monitor.source import resolve_target

KEYS = ("env/tool_call_rate", "env/reward_mean", "env/answer_reward_mean", "env/turns_mean", "env/tool_errors", "env/tool_latency_s",
        "env/prefill_tokens_saved")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    args = p.parse_args(argv)
    while True:  # run.json appears once the launcher has started Redis
        try:
            url, run_id = resolve_target(args.run_dir, None, None)
            break
        except ValueError:
            time.sleep(1.0)
    coord = Coordinator(url, run_id, outage_s=5.0)
    while True:
        try:
            latest = coord.latest_metrics()
        except Exception:  # noqa: BLE001 (Redis gone: the run has ended)
            return 0
        learner = latest.get("learner", {})
        workers = [m for name, m in latest.items() if name.startswith("rollout")]
        row = {"step": learner.get("learner/step"), "reward": learner.get("learner/reward_mean")}
        for k in KEYS:
            vals = [w[k] for w in workers if k in w]
            row[k] = sum(vals) / len(vals) if vals else None
        if row["step"] is not None:
            print(json.dumps(row), flush=True)
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
