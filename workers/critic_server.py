"""The critic role as its own process: a value model trained asynchronously on every batch the
rollout workers send it (see :mod:`streamrl.roles.critic`).

Started by the launcher when ``placement.critic`` is set and ``learner.advantage = gae``;
publishes the endpoint ``critic``, reports ``critic/*`` (throughput, value loss, explained
variance, step) to the monitor, checkpoints to ``<checkpoint dir>/critic.safetensors`` and resumes from
it after a restart.

    python -m streamrl.workers.critic_server --redis-url redis://... --run-id R [--device cuda:2]
"""
from __future__ import annotations

import sys

from streamrl.roles.critic import ROLE, CriticRole, critic_checkpoint_path, load_value_model
from streamrl.roles.serve import parse_role_args, serve_role


def main(argv=None) -> int:
    args = parse_role_args(ROLE, argv)

    def build(cfg, device):
        model = load_value_model(cfg)
        critic = CriticRole(cfg, model, device, critic_checkpoint_path(cfg))
        return critic, model.vocab_size, critic.train_pending

    return serve_role(ROLE, args, build)


if __name__ == "__main__":
    sys.exit(main())
