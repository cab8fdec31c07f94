"""Benchmarks (``streamrl-bench NAME``): each figure is a ratio measured side by side in one run."""
