"""Small process-level helpers: logging setup, thread limits, seeding, dying with the parent."""
from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading

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


def use_tf32(device: str | torch.device) -> None:
    """Let float32 matmuls on CUDA use TF32 tensor cores (process-wide; a no-op for other devices).

    Why: a float32 learner or engine otherwise runs its matmuls at full fp32 rate, several times
    slower on Ampere and later (inductor warns about it), while the updates it computes are
    already noisier than TF32's 10-bit mantissa. ``set_float32_matmul_precision`` rather than
    ``torch.backends.cuda.matmul.fp32_precision``: setting only the new per-backend flag makes a
    later read of the legacy ``allow_tf32`` (libraries still read it) raise in torch 2.13; this call
    keeps both views consistent. CPU processes are left alone: "high" would also switch oneDNN's
    CPU matmuls to TF32, and CPU runs keep their numerics.
    """
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# prctl(PR_SET_PDEATHSIG) through libc, resolved once here: ``die_with_parent`` also runs as a
# ``preexec_fn`` between fork and exec, where importing or loading libraries could deadlock.
_PR_SET_PDEATHSIG = 1
try:
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover - not Linux / no libc symbol
    _prctl = None


# Set by the launcher in its children's environment; torchrun passes it on to the ranks.
DIE_WITH_PARENT_ENV = "STREAMRL_DIE_WITH_PARENT"


def die_with_parent_if_launched(sig: int = signal.SIGTERM) -> bool:
    """:func:`die_with_parent` when the launcher asked for it (``STREAMRL_DIE_WITH_PARENT=1``).

    For processes whose parent is not the launcher itself: torchrun's ranks (the launcher's
    ``preexec_fn`` covers its direct children, but the request is not inherited across fork).
    """
    return os.environ.get(DIE_WITH_PARENT_ENV) == "1" and die_with_parent(sig)


def die_with_parent_preexec():
    """``preexec_fn`` for ``subprocess.Popen``: :func:`die_with_parent` when called on the main thread.

    The kernel ties the request to the *thread* that forked, not the process: a child started
    from a short-lived thread (a ``threading.Timer``, a pool) would be signalled as soon as that
    thread ends. Only the main thread lives as long as the process, so only there is it safe.
    """
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux only).

    Why: torchrun starts each rank in a session of its own, so killing the agent's process
    group (or the agent being SIGKILLed) leaves the ranks running, holding the port, the GPU
    and the Redis lease. The parent is the *thread* that forked us (see
    :func:`die_with_parent_preexec`); if it is already gone when we ask, we signal ourselves.
    Returns False where unsupported.
    """
    if _prctl is None:
        return False
    parent = os.getppid()
    if _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
    return True


def peak_rss_bytes() -> int:
    """Peak resident bytes of this process image (``VmHWM``; ``ru_maxrss`` would also count the
    parent's peak from before a spawn's exec). Linux only."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
