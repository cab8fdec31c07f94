"""GRPO / Dr.GRPO group advantages."""
import torch

from streamrl.algorithms.advantages import group_advantages


def test_grpo_and_dr_grpo_by_hand():
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 1.0])
    g = torch.tensor([7, 7, 9, 9, 4, 4])
    dr = group_advantages(r, g, normalize_std=False)
    assert torch.allclose(dr, torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0]))
    grpo = group_advantages(r, g, normalize_std=True, eps=0.0)
    # unbiased std of (1, 0) is sqrt(0.5); the equal group stays 0 instead of 0/0
    s = 0.5 ** 0.5
    assert torch.allclose(grpo[:2], torch.tensor([0.5 / s, -0.5 / s]))
    assert torch.all(grpo[2:4] == 0)
