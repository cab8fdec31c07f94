"""Micro-batches built while the device runs, and the step's metrics read once.

The trainer builds micro-batch i+1 (packing, device copy, block mask) right after launching
micro-batch i's backward instead of all of them before the first forward; the micro-batches
and their order must be exactly those of building them all up front. A step's metrics of every
minibatch are read from the device once, after the last optimizer step is queued.
"""
from __future__ import annotations

import pytest
import torch

from streamrl.bench.padded_reference import packed_gradients
from streamrl.learner import h2d, metrics as metrics_mod, packing
from streamrl.learner.packing import (LazyMicroBatches, TrajectoryView, build_microbatch, plan_microbatches,
                                      rank_microbatches)

from test_packing import _trainer, group_batch

_FIELDS = ("input_ids", "position_ids", "select", "targets", "grid_row", "grid_col", "token_weight", "replay",
           "segment_ids", "unit_ids")


def _same(a, b) -> None:
    for f in _FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and torch.equal(x, y))), f
    assert a.rows == b.rows and a.dummy == b.dummy
    assert (a.attention_mask is None) == (b.attention_mask is None)
    assert a.attention_mask is None or torch.equal(a.attention_mask, b.attention_mask)


@pytest.mark.parametrize("shared", [True, False])
def test_lazy_microbatches_equal_the_eager_build(shared):
    """Each micro-batch is built on its first access only, once, and equals the eager build of
    the same plan; the rank with fewer micro-batches gets zero-weight dummies as before."""
    batch = group_batch(4)
    rank_rows = [list(range(0, 9)), list(range(9, 12))]  # rank 1 packs into fewer micro-batches
    built = []
    for rank in (0, 1):
        micro, weights = rank_microbatches(batch, rank_rows, rank, 12, shared, num_layers=2,
                                           finish=lambda m: built.append(m) or m)
        view = TrajectoryView(batch)
        plans = [plan_microbatches(batch, rows, 12, shared, view) for rows in rank_rows]
        assert isinstance(micro, LazyMicroBatches) and len(micro) == max(len(p) for p in plans) > 1
        assert built == []  # nothing built before the loop reaches it
        eager = [build_microbatch(view, u, shared, 2) for u in plans[rank]]
        eager += [build_microbatch(view, [[0]], shared, 2, dummy=True)] * (len(micro) - len(eager))
        for i, want in enumerate(eager):
            got = micro[i]
            assert built[-1] is got and len(built) == i + 1
            _same(got, want)
        assert micro[0] is built[0] and len(built) == len(eager)  # kept, not rebuilt
        assert [m.rows for m in micro] == [m.rows for m in eager]  # iteration, in order
        assert any(m.dummy for m in micro) == (rank == 1)
        assert weights == [float(sum(int(batch["prompt_lens"][i] + batch["response_lens"][i])
                                     for p in plans if j < len(p) for u in p[j] for i in u))
                           for j in range(len(micro))]
        built.clear()


def test_next_microbatch_built_after_the_backward_is_launched(monkeypatch):
    """Events of one gradient pass: build i, forward i, backward i, then build i+1."""
    batch = group_batch(5)
    tr = _trainer(["learner.max_tokens_per_microbatch=12", "learner.aux_loss_coef=0"])
    events = []
    real = packing.build_microbatch
    monkeypatch.setattr(packing, "build_microbatch", lambda *a, **k: events.append("build") or real(*a, **k))
    tr.model.register_forward_pre_hook(lambda *_: events.append("forward"))
    emb = tr.model.get_input_embeddings().weight
    emb.register_hook(lambda g: events.append("backward"))  # its gradient comes last in the backward
    packed_gradients(tr, batch)
    n = events.count("build")
    assert n > 2
    assert events == ["build", "forward", "backward"] * n


def test_step_reads_the_metrics_once_and_they_equal_per_minibatch_reads(monkeypatch):
    """minibatches = 2, several micro-batches each, routers frozen for the first step: one read of
    the device for the whole step, the same metrics and weights as reading each minibatch's
    metrics after its own optimizer step (train_minibatch)."""
    batch = group_batch(6)
    extra = ["learner.minibatches=2", "learner.max_tokens_per_microbatch=12", "learner.aux_loss_coef=0",
             "learner.router_freeze_steps=2"]
    a, b = _trainer(extra), _trainer(extra)
    assert a.router.frozen
    reads = []
    real = metrics_mod.host_metrics_many
    monkeypatch.setattr(metrics_mod, "host_metrics_many", lambda accs: reads.append(len(accs)) or real(accs))
    m = a.step(batch)
    assert reads == [2]  # both minibatches' metrics in one read; no router gate read before 2 optimizer steps
    monkeypatch.setattr(metrics_mod, "host_metrics_many", real)

    grid, adv, mbs, plans = b._prepare(batch)
    b.model.train()
    with torch.no_grad():
        prox = [[b._run(b.model, x, grid_width=grid.width)[0] for x in micro] for micro, _ in plans]
    per = [metrics_mod.read_minibatch_metrics([b.train_minibatch(batch, grid, adv, mb, plans[j], prox[j])], b.world)[0]
           for j, mb in enumerate(mbs)]
    for k in per[0]:
        assert m[k] == pytest.approx(sum(p[k] for p in per) / len(per), rel=1e-6, abs=1e-9), k
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
    # past router_freeze_steps the unfreeze gate reads the router metrics before the optimizer step
    reads.clear()
    monkeypatch.setattr(metrics_mod, "host_metrics_many", lambda accs: reads.append(len(accs)) or real(accs))
    a.step(batch)
    assert reads == [1, 2] and not a.router.frozen


def test_h2d_grouped_keeps_every_tensor():
    """Tensors of mixed dtypes and shapes (empty ones too) through one buffer per dtype: the same
    values, dtypes and shapes (on CPU without pinning; the GPU case is in test_packing_gpu)."""
    g = torch.Generator().manual_seed(0)
    ts = {"ids": torch.randint(0, 50, (1, 7), generator=g), "sel": torch.arange(3),
          "empty": torch.zeros(0, dtype=torch.int64), "w": torch.rand(7, generator=g),
          "replay": torch.randint(-1, 4, (7, 2, 2), generator=g), "mask": torch.rand(1, 1, 7, 7, generator=g) > 0.5,
          "cols": torch.rand(4, 6, generator=g)[:, ::2]}  # not contiguous
    out = h2d.h2d_grouped(ts, torch.device("cpu"), pin=False)
    assert out.keys() == ts.keys()
    for k, t in ts.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k
        assert out[k].is_contiguous() and out[k].data_ptr() % 16 == 0, k  # what compiled kernels assume


def _reference_build(view, units, shared, num_layers=0, dummy=False, dense_mask=True, feed_last=True):
    """build_microbatch as it was, one tensor op per sequence: the reference of the vectorised one."""
    ids, pos = [], []
    # one (segment, unit, token weight, length) run per prompt or response: expanded to [N] by
    # repeat_interleave at the end (per-token Python lists of a 32k-token row took ~20 ms)
    seg, unit_of, weight, run_len = [], [], [], []
    select, targets, g_row, g_col = [], [], [], []
    replay_at: list[tuple[int, int]] = []  # (row position, trajectory) of the first token of a segment
    rows: list[int] = []
    n = 0
    for u_idx, unit in enumerate(units):
        p = view.p_lens[unit[0]]
        prompt = view.prompt(unit[0])
        ids.append(prompt[: p - 1])
        pos.append(torch.arange(p - 1))
        seg.append(-1)
        unit_of.append(u_idx)
        weight.append(float(len(unit)))
        run_len.append(p - 1)
        n += p - 1
        for i in unit:
            r = view.r_lens[i]
            resp = view.response_tokens[view.r_off[i] : view.r_off[i] + r]
            fed = r + 1 if feed_last or r == 0 else r  # the segment's tokens in the row
            ids.append(torch.cat([view.prompt(i)[p - 1 :], resp])[:fed])
            pos.append(torch.arange(p - 1, p - 1 + fed))
            seg.append(len(rows))
            unit_of.append(u_idx)
            weight.append(1.0)
            run_len.append(fed)
            select.append(torch.arange(n, n + r))
            targets.append(resp)
            g_row.append(torch.full((r,), len(rows), dtype=torch.int64))
            g_col.append(torch.arange(r))
            replay_at.append((n, i))
            rows.append(i)
            n += fed
    input_ids = torch.cat(ids).long()[None]
    position_ids = torch.cat(pos).long()[None]
    run_of_token = torch.repeat_interleave(torch.tensor(run_len, dtype=torch.int64))  # [N]
    seg_ids = torch.tensor(seg, dtype=torch.int64)[run_of_token]
    unit_ids = torch.tensor(unit_of, dtype=torch.int64)[run_of_token]
    mask = None
    if dense_mask and shared and any(len(u) > 1 for u in units):
        mask = packing.dense_packed_mask(seg_ids, unit_ids)
    replay = None
    if view.routed is not None and num_layers:
        k = view.routed.shape[-1]
        if view.routed.shape[1] != num_layers:
            raise ValueError(f"routed_experts has {view.routed.shape[1]} layers, the model has {num_layers} MoE layers")
        replay = torch.full((n, num_layers, k), -1, dtype=torch.int64)
        for start, i in replay_at:
            r = view.r_lens[i]
            replay[start : start + r] = view.routed[view.r_off[i] : view.r_off[i] + r].long()
    tw = torch.tensor(weight, dtype=torch.float32)[run_of_token] * (0.0 if dummy else 1.0)
    cat = lambda xs, dt=torch.int64: torch.cat(xs).to(dt) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    return packing.MicroBatch(input_ids, position_ids, mask, cat(select), cat(targets), cat(g_row), cat(g_col), tw,
                              replay, rows, seg_ids, unit_ids, dummy)


@pytest.mark.parametrize("shared,feed_last,dense_mask", [(True, True, True), (True, False, False),
                                                          (False, True, True), (False, False, True)])
def test_vectorised_build_equals_the_per_sequence_build(shared, feed_last, dense_mask):
    """Every field equal to the per-sequence construction it replaced: shared prompts or not,
    with and without each sample's last token, R3 replay ids, empty responses, a dummy."""
    batch = group_batch(7, groups=4, g=3)
    view = TrajectoryView(batch)
    for budget in (10_000, 25):
        for units in plan_microbatches(batch, list(range(12)), budget, shared, view):
            for dummy in (False, True):
                kw = dict(num_layers=2, dummy=dummy, dense_mask=dense_mask, feed_last=feed_last)
                _same(build_microbatch(view, units, shared, **kw), _reference_build(view, units, shared, **kw))


def test_vectorised_build_with_empty_responses():
    """A response of 0 tokens keeps the sample's last prompt token in the row (as before)."""
    from streamrl.trajectory import pack_trajectories

    prompts = [[1, 5, 6], [1, 5, 6], [1, 7]]
    resp = [[9, 9], [], [4]]
    batch = pack_trajectories(prompts, resp, [[-0.5] * len(r) for r in resp], [[0] * len(r) for r in resp],
                              [0.1, 0.2, 0.3], [0, 0, 1], [0, 1, 2], 0, 0.0)
    view = TrajectoryView(batch)
    for shared in (True, False):
        for feed_last in (True, False):
            units = plan_microbatches(batch, [0, 1, 2], 10_000, shared, view)[0]
            got = build_microbatch(view, units, shared, feed_last=feed_last)
            _same(got, _reference_build(view, units, shared, feed_last=feed_last))


def test_response_grid_lays_out_each_response():
    from streamrl.learner.packing import response_grid

    batch = group_batch(8)
    r = batch["response_lens"].tolist()
    grid = response_grid(batch, "behaviour_logprobs", fill=7.0)
    assert grid.shape == (len(r), max(r))
    flat = batch["behaviour_logprobs"]
    o = 0
    for i, n in enumerate(r):
        assert torch.equal(grid[i, :n], flat[o : o + n]) and bool((grid[i, n:] == 7.0).all())
        o += n
