"""Device mesh and parallelism (data-parallel shard x expert-parallel)."""
