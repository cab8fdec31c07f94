"""FlexAttention over packed rows (``learner.attention = flex``) computes what the sdpa path does.

On CPU torch runs FlexAttention's forward unfused and refuses its backward, so the CPU tests
check the block mask against the dense mask tile by tile and the forward log-probs of flex
against sdpa (plain packing and shared prompts, a tiny Qwen3-MoE); the gradient equality runs
on a GPU (``-m gpu``).
"""
from __future__ import annotations

import pytest
import torch

from streamrl.config import ConfigError, load_config
from streamrl.learner import attention
from streamrl.learner.attention import (dense_packed_mask, packed_block_mask, parse_flex_options, resolve_attention,
                                         set_flex_kernel_options)
from streamrl.learner.packing import TrajectoryView, build_microbatch, plan_microbatches
from streamrl.learner.trainer import Trainer, one_causal_sequence

from test_checkpoint import REPO
from test_packing import BASE, _full_grads, group_batch


def _trainer(extra=()):
    return Trainer(load_config(f"{REPO}/configs/tiny.yaml", [*BASE, *extra]))


@pytest.mark.parametrize("shared", [False, True])
def test_block_mask_is_the_dense_mask(shared):
    """Every 128 x 128 tile the BlockMask marks full is all-visible in the dense mask, every
    tile it leaves out is all-hidden, and its mask_mod gives the dense mask exactly."""
    batch = group_batch(7, groups=24, g=4)
    view = TrajectoryView(batch)
    plan = plan_microbatches(batch, list(range(96)), budget=100_000, shared=shared, view=view)
    mb = build_microbatch(view, plan[0], shared=shared, dense_mask=False)
    assert mb.attention_mask is None and mb.num_tokens > 256  # several tiles
    dense = dense_packed_mask(mb.segment_ids, mb.unit_ids)[0, 0]
    bm = packed_block_mask(mb.segment_ids, mb.unit_ids)
    n = mb.num_tokens
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(bm.mask_mod(0, 0, q, k), dense)
    tiles = bm.to_dense()[0, 0].bool()  # [Nq/128, Nk/128]: tile computed at all
    bs = bm.BLOCK_SIZE[0]
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tile = dense[i * bs : (i + 1) * bs, j * bs : (j + 1) * bs]
            assert bool(tiles[i, j]) == bool(tile.any()), (i, j)
    full = _tile_set(bm.full_kv_num_blocks, bm.full_kv_indices, tiles.shape)
    for i, j in full.nonzero().tolist():  # a full tile is applied without the mask_mod
        assert bool(dense[i * bs : (i + 1) * bs, j * bs : (j + 1) * bs].all()), (i, j)
    assert tiles.float().mean() < 0.6  # most of the row is skipped: many short units
    if shared:  # the sdpa path's dense mask is the same rule
        assert torch.equal(build_microbatch(view, plan[0], shared=True).attention_mask[0, 0], dense)


def _tile_set(num_blocks: torch.Tensor, indices: torch.Tensor, shape) -> torch.Tensor:
    """[Q, K] bool: the tiles a BlockMask table (counts [1, 1, Q], indices [1, 1, Q, K]) lists."""
    out = torch.zeros(shape, dtype=torch.bool)
    for q, count in enumerate(num_blocks[0, 0].tolist()):
        out[q, indices[0, 0, q, :count].long()] = True
    return out


@pytest.mark.parametrize("seed", range(4))
def test_block_mask_tiles_match_create_block_mask(seed):
    """The tile tables built from per-tile ranges are torch's ``create_block_mask`` tables (which
    evaluates the rule on every pair): random groups (0-130 prompt tokens, 1-300-token samples,
    tile edges anywhere), partial and full tiles alike."""
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):
        seg, unit, sample = [], [], 0
        for u in range(int(torch.randint(1, 6, (1,), generator=gen))):
            prompt = [0, 1, 17, 64, 130][int(torch.randint(0, 5, (1,), generator=gen))]
            seg += [-1] * prompt
            unit += [u] * prompt
            for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
                n = int(torch.randint(1, 300, (1,), generator=gen))
                seg += [sample] * n
                unit += [u] * n
                sample += 1
        seg, unit = torch.tensor(seg), torch.tensor(unit)
        n = len(seg)
        ours = packed_block_mask(seg, unit)
        ref = create_block_mask(ours.mask_mod, 1, None, n, n, device="cpu")
        shape = ref.kv_indices.shape[-2:]
        for counts, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            assert torch.equal(_tile_set(getattr(ours, counts), getattr(ours, idx), shape),
                               _tile_set(getattr(ref, counts), getattr(ref, idx), shape)), (counts, n)
        assert ours.seq_lengths == ref.seq_lengths == (n, n)


@pytest.mark.parametrize("shared", [False, True])
def test_flex_forward_equals_sdpa(shared):
    """Same weights, same micro-batches: log-probs and entropy of flex == sdpa (eval, no grad)."""
    batch = group_batch(3)
    extra = [f"learner.shared_prompt={'true' if shared else 'false'}", "learner.max_tokens_per_microbatch=40"]
    ref, flex = _trainer([*extra, "learner.attention=sdpa"]), _trainer([*extra, "learner.attention=flex"])
    assert flex.attention == "flex" and ref.attention == "sdpa"
    flex.model.load_state_dict(ref.model.state_dict())
    _, _, _, plans_r = ref._prepare(batch)
    _, _, _, plans_f = flex._prepare(batch)
    micro_r, micro_f = plans_r[0][0], plans_f[0][0]
    assert len(micro_r) == len(micro_f) > 1
    width = int(batch["response_lens"].max())
    for tr in (ref, flex):
        tr.model.eval()
    with torch.no_grad():
        for mr, mf in zip(micro_r, micro_f):
            # a BlockMask over several sequences or a shared prompt; a single plain sequence uses sdpa's causal path
            assert (mf.attention_mask is None) == one_causal_sequence(mf)
            assert mf.attention_mask is None or not isinstance(mf.attention_mask, torch.Tensor)
            lr, er, _, _ = ref._run(ref.model, mr, width, entropy=True)
            lf, ef, _, _ = flex._run(flex.model, mf, width, entropy=True)
            assert torch.allclose(lf, lr, atol=2e-5), (lf - lr).abs().max()
            assert torch.allclose(ef, er, atol=2e-5)


def test_single_sequence_rows_skip_the_block_mask():
    """Budget of one sequence per row: no BlockMask (sdpa's causal kernel), same log-probs."""
    batch = group_batch(3)
    ref = _trainer(["learner.max_tokens_per_microbatch=1", "learner.attention=sdpa"])
    flex = _trainer(["learner.max_tokens_per_microbatch=1", "learner.attention=flex"])
    flex.model.load_state_dict(ref.model.state_dict())
    micro_r, micro_f = ref._prepare(batch)[3][0][0], flex._prepare(batch)[3][0][0]
    assert all(len(m.rows) == 1 and m.attention_mask is None for m in micro_f)
    width = int(batch["response_lens"].max())
    with torch.no_grad():
        for mr, mf in zip(micro_r, micro_f):
            assert torch.allclose(flex._run(flex.model, mf, width)[0], ref._run(ref.model, mr, width)[0], atol=2e-5)


def test_flex_kernel_options(monkeypatch):
    """The bench's ``--flex-options``: parsed strictly, passed to every flex call as ``kernel_options``."""
    opts = parse_flex_options("fwd_BLOCK_M=64, fwd_BLOCK_N=128,bwd_BLOCK_M1=32,ROWS_GUARANTEED_SAFE=true")
    assert opts == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "bwd_BLOCK_M1": 32, "ROWS_GUARANTEED_SAFE": True}
    assert parse_flex_options("") == {}
    for bad in ("BLOCK_Q=64", "fwd_BLOCK_M", "BLOCK_M=-1", "num_warps=four"):
        with pytest.raises(ValueError, match="flex kernel option"):
            parse_flex_options(bad)
    from streamrl.bench.learner import main as bench_learner

    assert bench_learner(["--synthetic-moe", "--flex-options", "BLOCK_Q=64"]) == 2  # refused before any work
    seen, real = [], attention._eager_flex()

    def recording_flex(*args, **kwargs):
        seen.append(kwargs["kernel_options"])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "_eager_flex", lambda: recording_flex)
    batch = group_batch(3)
    tr = _trainer(["learner.max_tokens_per_microbatch=40", "learner.attention=flex"])
    mb = tr._prepare(batch)[3][0][0][0]
    assert mb.attention_mask is not None  # a BlockMask row
    width = int(batch["response_lens"].max())
    try:
        with torch.no_grad():
            set_flex_kernel_options({"fwd_BLOCK_M": 64})
            with_opts = tr._run(tr.model, mb, width)[0]
            set_flex_kernel_options({})
            plain = tr._run(tr.model, mb, width)[0]
    finally:
        set_flex_kernel_options({})
    assert seen and seen[0] == {"fwd_BLOCK_M": 64} and seen[-1] is None
    assert torch.equal(with_opts, plain)


def test_attention_setting():
    assert resolve_attention("auto", "cuda") == "flex" and resolve_attention("auto", "cpu") == "segments"
    assert resolve_attention("sdpa", "cuda") == "sdpa"
    with pytest.raises(ConfigError, match="learner.attention"):
        load_config(f"{REPO}/configs/tiny.yaml", ["learner.attention=fast"])


def test_metrics_read_once_match_the_padded_step():
    """The step's metrics (read from the device once) are the padded reference's, grad_norm included."""
    from streamrl.bench.padded_reference import packed_gradients, padded_step

    batch = group_batch(4)
    extra = ["learner.max_tokens_per_microbatch=24", "learner.aux_loss_coef=0", "learner.entropy_coef=0.01"]
    a, b = _trainer(extra), _trainer(extra)
    ref = padded_step(a, batch)
    got = b.step(batch)
    for k in ("learner/loss", "learner/grad_norm", "learner/entropy", "learner/clip_frac", "moe/z_loss",
              "moe/router_entropy", "moe/router_entropy/layer1"):  # (usage std pools per micro-batch)
        assert isinstance(got[k], float), k
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), k
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):  # the clipped gradients
        assert torch.allclose(pb.grad, pa.grad, atol=2e-6, rtol=1e-4), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("shared", [False, True])
def test_flex_gradients_equal_sdpa_on_gpu(shared):
    batch = group_batch(3)
    extra = ["learner.device=cuda", "model.dtype=float32", "learner.mixed_precision=false",
             f"learner.shared_prompt={'true' if shared else 'false'}", "learner.max_tokens_per_microbatch=40",
             "learner.aux_loss_coef=0"]
    ref, flex = _trainer([*extra, "learner.attention=sdpa"]), _trainer([*extra, "learner.attention=flex"])
    flex.model.load_state_dict(ref.model.state_dict())
    mr, mf = packed_gradients(ref, batch), packed_gradients(flex, batch)
    assert mf["learner/loss"] == pytest.approx(mr["learner/loss"], rel=1e-4, abs=1e-6)
    gr, gf = _full_grads(ref), _full_grads(flex)
    assert gr and gr.keys() == gf.keys()
    for n, g in gr.items():
        assert torch.allclose(gf[n], g, atol=1e-4, rtol=1e-3), n
