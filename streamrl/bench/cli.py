"""``streamrl-bench NAME [args]``: dispatch to ``streamrl.bench.NAME.main(argv)``.

Each benchmark module defines ``main(argv) -> int``; with ``--json`` its last printed line
is one JSON object with the figures. Modules are imported lazily so ``--help`` is fast.
"""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "transport": "trajectory transport vs raw ZeroMQ, pickle over ZeroMQ, JSON over Redis streams",
    "weights": "weight broadcast: publish() to last ack, split gather/transfer/load",
    "rollout": "rollout worker loop vs the bare engine generate",
    "e2e": "asynchronous vs synchronous training, same config and resources",
    "lora": "LoRA adapter versions vs full weights (bytes, seconds) and merged vs unmerged adapters",
    "learner": "learner step: padded full-vocab (before) vs packed micro-batches vs shared-prompt groups",
    "race": "time to held-out accuracy: StreamRL vs TRL's GRPOTrainer, same model, prompts and budget",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: streamrl-bench NAME [--json] [options]\n\nbenchmarks:")
        for name, doc in BENCHMARKS.items():
            print(f"  {name:<10} {doc}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"streamrl-bench: unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"streamrl.bench.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"streamrl.bench.{name}":
            print(f"streamrl-bench: benchmark {name!r} is not built yet", file=sys.stderr)
            return 2
        raise
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
