"""The rollout side: turn problems into scored trajectory batches for a policy version.

* :mod:`.base`: the :class:`~streamrl.rollout.base.Roller` protocol the rollout worker talks to;
* :mod:`.batch`: single-turn grouped sampling (:class:`~streamrl.rollout.batch.BatchRoller`);
  multi-turn tool episodes live in :mod:`streamrl.envs.roller`;
* :mod:`.stream`: single-turn, continuous: slots refilled and groups sent as they finish
  (:class:`~streamrl.rollout.stream.StreamingRoller`, ``rollout.streaming``);
* :mod:`.scoring`: what both single-turn rollers share (prompts, rewards, truncation rule, ids, packing);
* :mod:`.factory`: the roller a run's config asks for;
* :mod:`.prompts`: problem -> prompt token ids (shared with the evaluator);
* :mod:`.metrics`: per-batch figures computed from a packed batch.
"""
