"""Micro-batches on the GPU: moving one that is already there (a second pass over the same batch,
as the flex path's single-sequence rows get) must not try to pin device memory (it crashed the
first 1k-token GPU runs: "cannot pin 'torch.cuda.LongTensor'")."""
from __future__ import annotations

import pytest
import torch

from streamrl.learner.packing import TrajectoryView, build_microbatch, plan_microbatches
from tests.test_packing import group_batch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_microbatch_moves_to_the_gpu_twice():
    batch = group_batch(5, groups=2, g=3)
    view = TrajectoryView(batch)
    plan = plan_microbatches(batch, list(range(6)), budget=10_000, shared=True, view=view)
    mb = build_microbatch(view, plan[0], shared=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    once = mb.to(dev)
    twice = once.to(dev)
    assert twice.input_ids.is_cuda and torch.equal(twice.input_ids.cpu(), mb.input_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_microbatch_on_the_gpu_equals_the_host_one():
    """One staging buffer and one copy per dtype: every field equal, same dtype and shape."""
    from streamrl.learner.packing import _TENSOR_FIELDS

    batch = group_batch(5, groups=2, g=3)
    view = TrajectoryView(batch)
    plan = plan_microbatches(batch, list(range(6)), budget=10_000, shared=True, view=view)
    mb = build_microbatch(view, plan[0], shared=True, num_layers=2)
    on = mb.to(torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    for f in _TENSOR_FIELDS:
        a, b = getattr(mb, f), getattr(on, f)
        assert (a is None) == (b is None), f
        if a is not None:
            assert b.is_cuda and b.dtype == a.dtype and b.shape == a.shape and torch.equal(b.cpu(), a), f
