"""Learner: staleness-aware buffer, FSDP2 trainer, batch distribution across ranks."""
