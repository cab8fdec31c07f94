"""Run a function on N local gloo ranks (spawned processes) and collect what each returns.

For tests and quick checks of distributed code on CPU: every process gets ``RANK``,
``WORLD_SIZE``, a fresh TCP rendezvous on a free loopback port and one intra-op thread.
Results come back as ``torch.save`` bytes through a queue from this process's own children
(loaded with ``weights_only=True``: tensors, numbers, strings, lists and dicts),
bounded by ``timeout_s``; a rank that raises or hangs fails the whole call and every child
is killed by its own pid.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, q):
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # Bytes, not shared-memory tensors: a child may exit before the parent unpickles.
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report, never hang the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_gloo(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns the results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            try:
                rank, status, value = q.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"distributed run did not finish within {timeout_s} s") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            import torch

            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def assert_ranks_match_reference(ref: dict, outs: list[dict], atol: float = 2e-5) -> None:
    """Every rank's ``{"metrics": {k: float}, "params": {name: tensor}}`` equals the 1-rank ``ref``.

    Metrics to a relative 1e-4; parameters (full tensors) to ``atol`` absolute.
    """
    import pytest
    import torch

    for o in outs:
        for k, v in ref["metrics"].items():
            assert o["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        assert o["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            assert torch.allclose(o["params"][k], v, atol=atol, rtol=0), (k, (o["params"][k] - v).abs().max())
