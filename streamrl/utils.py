"""Small process-level helpers: logging setup, thread limits, seeding."""
from __future__ import annotations

import logging
import os
import random
import sys

import torch


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("STREAMRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return logging.getLogger(name)


def limit_threads(n: int | None = None) -> None:
    """Cap intra-op threads (default 1): several processes share a 2-core machine."""
    n = n or int(os.environ.get("STREAMRL_THREADS", "1"))
    torch.set_num_threads(n)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
