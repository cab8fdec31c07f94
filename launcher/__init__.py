"""``streamrl-launch``: starts Redis, the learner job and rollout workers, and supervises them."""
