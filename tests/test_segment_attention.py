"""Per-segment attention (the CPU learner's default) equals sdpa with the dense packed mask, and a
dense model's packed rows, which leave each sample's last token out, train exactly like the
padded step."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from streamrl.bench.padded_reference import packed_gradients, padded_step
from streamrl.config import load_config
from streamrl.learner.attention import dense_packed_mask
from streamrl.learner.packing import TrajectoryView, build_microbatch, plan_microbatches
from streamrl.learner.segment_attention import SegmentLayout, segment_attention
from streamrl.learner.trainer import Trainer

from test_bench_learner import save_tiny_llama
from test_checkpoint import REPO
from test_packing import group_batch


def _ids(seg: list[int], unit: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(seg), torch.tensor(unit)


LAYOUTS = {
    # two shared-prompt units, then two units whose prompt is a single token (no shared part)
    "shared": _ids([-1] * 3 + [0] * 2 + [1] * 4 + [-1] * 5 + [2] * 1 + [3] * 3 + [4] * 3 + [5],
                   [0] * 9 + [1] * 9 + [2] * 3 + [3]),
    # plain packing: every unit one sample
    "plain": _ids([-1] * 4 + [0] * 3 + [-1] * 2 + [1] * 6, [0] * 7 + [1] * 8),
    "one_segment": _ids([0] * 5, [0] * 5),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_segment_attention_equals_dense_mask(name):
    seg, unit = LAYOUTS[name]
    n = seg.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_packed_mask(seg, unit), enable_gqa=True)
    out = segment_attention(q, k, v, SegmentLayout.from_ids(seg, unit), scaling=None)
    assert out.shape == (1, n, 6, 8)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-12, rtol=0)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), up), torch.autograd.grad(ref.transpose(1, 2), (q, k, v), up)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_layout_of_packed_microbatches():
    """Every row token is a query exactly once, and its output is read from its own query's slot;
    a segment's keys are its unit's prompt and itself."""
    batch = group_batch(7, groups=3, g=4)
    view = TrajectoryView(batch)
    for units in plan_microbatches(batch, list(range(12)), budget=40, shared=True, view=view):
        mb = build_microbatch(view, units, shared=True, dense_mask=False, feed_last=False)
        lay = SegmentLayout.from_ids(mb.segment_ids, mb.unit_ids)
        assert torch.equal(lay.q_index[lay.order], torch.arange(mb.num_tokens))
        assert lay.order.unique().numel() == mb.num_tokens
        u, p, n_seg, l = lay.shapes
        seg_q = lay.q_index[u * p:].view(n_seg, l)
        seg_k = lay.k_index[u * p:].view(n_seg, p + l)
        for s in range(n_seg):
            keys = seg_k[s][lay.seg_mask[s, 0, 0]]  # what the segment's first token sees
            seg_id = int(mb.segment_ids[seg_q[s, 0]])
            unit = mb.unit_ids[seg_q[s, 0]]
            want = ((mb.unit_ids == unit) & (mb.segment_ids < 0)).nonzero()[:, 0].tolist()
            assert keys.tolist() == want + [int(seg_q[s, 0])], seg_id


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden_size=64, head_dim=32)


@pytest.mark.parametrize("extra", [
    [],  # CPU default: attention by segments, shared prompts
    ["learner.attention=sdpa"],
    ["learner.shared_prompt=false", "learner.max_tokens_per_microbatch=20", "learner.entropy_coef=0.01"],
])
def test_dense_packed_rows_without_last_token_equal_padded(dense_folder, extra):
    tr = Trainer(load_config(f"{REPO}/configs/tiny.yaml", [f"model.path={dense_folder}", "learner.lr=1e-3",
                                                            "learner.skip_no_signal=false", *extra]))
    assert not tr.is_moe and tr.attention == ("sdpa" if "learner.attention=sdpa" in extra else "segments")
    batch = group_batch(3)
    ref = padded_step(tr, batch, optimizer_step=False)
    ref_g = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    m = packed_gradients(tr, batch)
    for key in ("learner/loss", "learner/entropy"):
        if key in ref:
            assert m[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_g[n], atol=2e-6, rtol=1e-4)
    # the rows hold no sample's last response token: prompt (once per unit) + last prompt token + r - 1
    micro, _ = tr._microbatches(batch, list(range(12)))
    p, r = batch["prompt_lens"].tolist(), batch["response_lens"].tolist()
    shared = "learner.shared_prompt=false" not in extra
    want = sum(p[u[0]] - 1 + sum(r[i] for i in u)
               for units in plan_microbatches(batch, list(range(12)), tr.cfg.learner.max_tokens_per_microbatch, shared)
               for u in units)
    assert sum(mb.num_tokens for mb in micro) == want
