"""Hybrid roles run as their own processes (the reward model today), with their clients."""
