"""Process entry points: ``streamrl.workers.learner`` and ``streamrl.workers.rollout``."""
