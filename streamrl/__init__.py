"""StreamRL: asynchronous streaming actor-learner RL post-training for (MoE) language models.

The library: config schema, trajectory contract and transport, Redis coordination, weight
broadcast, models, algorithms, learner, engines, metrics and monitoring. Process entry points
live in ``streamrl.workers`` and ``streamrl.launcher``.
"""

__version__ = "0.1.0"
