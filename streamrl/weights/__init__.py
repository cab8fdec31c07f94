"""Versioned weight broadcast: learner publisher, worker subscriber, Redis manifests."""
