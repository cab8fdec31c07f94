"""The reference role as its own process: loads the reference model once (``reference.path``,
default the initial policy) on its own device and scores every rollout worker's batches:
``ref_logprobs`` per response token (see :mod:`streamrl.roles.reference`).

Started by the launcher when ``placement.reference`` is set and ``learner.kl_coef > 0``; reads
the run config from Redis, binds a free port, publishes ``tcp://<advertise>:<port>`` as the
endpoint ``reference`` and reports ``reference/*`` counters to the monitor.

    python -m streamrl.workers.reference_server --redis-url redis://... --run-id R [--device cuda:1]
"""
from __future__ import annotations

import sys

from streamrl.roles.reference import ROLE, ReferenceScorer, load_reference_model
from streamrl.roles.serve import parse_role_args, serve_role


def main(argv=None) -> int:
    args = parse_role_args(ROLE, argv)

    def build(cfg, device):
        model = load_reference_model(cfg)
        scorer = ReferenceScorer(model, cfg.rollout.temperature, cfg.reference.max_tokens, device)
        return scorer, int(model.config.vocab_size), None

    return serve_role(ROLE, args, build)


if __name__ == "__main__":
    sys.exit(main())
