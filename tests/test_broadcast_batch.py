"""broadcast_batch: every schema key (required and optional, any dtype/ndim) reaches every gloo rank intact."""
from __future__ import annotations

import torch

from tests.dist_helpers import spawn_gloo


def _batch():
    from streamrl.trajectory import pack_trajectories

    td = pack_trajectories(
        prompts=[[5, 6, 7], [8, 9]], responses=[[10, 2], [11, 12, 2]],
        logprobs=[[-0.5, -0.1], [-1.0, -0.2, -0.3]], versions=[[3, 3], [4, 4, 4]],
        rewards=[0.5, 1.0], group_ids=[7, 7], traj_ids=[100, 101], worker_id=1, created_at=123.5)
    td["response_mask"][1] = False  # a bool with a hole: exercises the uint8 path and alignment
    td["routed_experts"] = torch.arange(5 * 2 * 2, dtype=torch.int16).view(5, 2, 2)
    td["reward_components"] = torch.tensor([[0.5, 0.0], [1.0, 0.1]])
    return td


def _run(rank, world):
    from streamrl.learner.distributed import broadcast_batch

    td = broadcast_batch(_batch() if rank == 0 else None)
    return {k: td[k].clone() for k in td.keys()}


def test_broadcast_batch_two_ranks_bit_exact():
    expected = _batch()
    for got in spawn_gloo(_run, 2, timeout_s=120):
        assert set(got) == set(expected.keys())
        for k in expected.keys():
            assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
