"""Data plane from rollout workers to the learner: codec and ZeroMQ channel."""
