"""DCP checkpoints: save -> kill -> resume continues bit-for-bit (1 rank in-process, 2 gloo ranks)."""
from __future__ import annotations

import os

import pytest
import torch

from streamrl.config import load_config
from streamrl.learner.run_checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints,
                                         load_checkpoint, save_checkpoint)
from streamrl.learner.trainer import Trainer
from streamrl.trajectory import pack_trajectories

from tests.dist_helpers import spawn_gloo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_batch(seed: int, n: int = 8):
    """A deterministic synthetic batch of ``n`` trajectories in 2 groups."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(3, 20, (4,), generator=g).tolist() for _ in range(n)]
    resp = [torch.randint(3, 20, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    lps = [(-torch.rand(len(r), generator=g) * 2).tolist() for r in resp]
    return pack_trajectories(prompts, resp, lps, [[0] * len(r) for r in resp], torch.rand(n, generator=g).tolist(),
                             [i // 4 for i in range(n)], list(range(n)), 0, 0.0)


def _cfg(tmp, ep=1, extra=()):
    return load_config(f"{REPO}/configs/tiny.yaml", [f"run.run_dir={tmp}", f"learner.ep={ep}", "learner.router_ema=0.9",
                                                     "learner.lr=1e-2", *extra])


def _params(tr) -> dict[str, torch.Tensor]:
    return {name: t.clone() for (name, _, _), t in zip(tr.param_specs, tr.full_tensors())}


def _run(tmp, ep, steps, save_at=None, resume=False):
    """Train ``steps`` steps (from a checkpoint when ``resume``); returns losses and full params."""
    cfg = _cfg(tmp, ep)
    tr = Trainer(cfg)
    start = 0
    if resume:
        meta, _, _ = load_checkpoint(latest_checkpoint(tmp / "ck"), tr)
        start = meta["step"]
    losses = []
    for s in range(start, steps):
        # a dropout-free model still draws from the RNG in sampling code: consume it to test RNG restore
        noise = float(torch.rand(()))
        m = tr.step(make_batch(100 + s))
        losses.append((m["learner/loss"], m["learner/grad_norm"], noise))
        if save_at is not None and s + 1 == save_at:
            save_checkpoint(tmp / "ck", s + 1, tr, {"version": s + 1}, keep_last=2)
            return losses, None  # "killed" right after the save: nothing else survives
    return losses, _params(tr)


def _compare(full, first, resumed):
    losses_full, params_full = full
    assert first[0] + resumed[0] == losses_full  # bit-for-bit: exact float equality
    for k, v in params_full.items():
        assert torch.equal(v, resumed[1][k]), k


def test_resume_is_bit_exact_single_rank(tmp_path):
    torch.manual_seed(0)
    full = _run(tmp_path / "a", 1, 4)
    torch.manual_seed(0)
    first = _run(tmp_path, 1, 4, save_at=2)
    torch.manual_seed(123)  # a different process state: resume must restore the RNG
    resumed = _run(tmp_path, 1, 4, resume=True)
    _compare(full, first, resumed)


def test_keep_last_and_old_format_refused(tmp_path):
    tr = Trainer(_cfg(tmp_path))
    for s in (1, 2, 3):
        save_checkpoint(tmp_path / "ck", s, tr, {}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step_00000002", "step_00000003"]
    (tmp_path / "ck" / ".tmp_step_00000009").mkdir()  # a crashed save is never picked
    assert latest_checkpoint(tmp_path / "ck").name == "step_00000003"
    import json
    meta = tmp_path / "ck" / "step_00000003" / "learner_state.json"
    old = {k: v for k, v in json.loads(meta.read_text()).items() if k != "format"}
    meta.write_text(json.dumps({**old, "ep": 2}))  # what the per-ep-slice format wrote
    with pytest.raises(CheckpointError, match="per-rank expert slices"):
        load_checkpoint(tmp_path / "ck" / "step_00000003", tr)


def test_buffer_and_seen_ids_round_trip(tmp_path):
    from streamrl.learner.buffer import StalenessBuffer

    tr = Trainer(_cfg(tmp_path))
    buf = StalenessBuffer(group_size=4, max_staleness=2)
    buf.add(make_batch(5, n=6))
    items, meta = buf.export_state()
    path = save_checkpoint(tmp_path / "ck", 1, tr, {"buffer": meta}, buffer_items=items, seen_ids=[7, 9, 11])
    state, items2, seen = load_checkpoint(path, tr)
    assert seen == [7, 9, 11]
    buf2 = StalenessBuffer(group_size=4, max_staleness=2)
    buf2.load_state(items2, state["buffer"])
    assert buf2.pending_trajectories() == 6 and buf2.complete_groups() == 1
    a, b = buf.take(1, 0), buf2.take(1, 0)
    for k in a.keys():
        assert torch.equal(a[k], b[k])


def _dist_run(rank, world, tmp, ep, mode):
    tmp = __import__("pathlib").Path(tmp)
    torch.manual_seed(0 if mode != "resume" else 77)
    if mode == "full":
        return _run(tmp, ep, 4)
    if mode == "first":  # returns right after the save: the processes end without a clean stop
        return _run(tmp, ep, 4, save_at=2)
    return _run(tmp, ep, 4, resume=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ep", [1, 2])
def test_resume_is_bit_exact_two_ranks(tmp_path, ep):
    full = spawn_gloo(_dist_run, 2, str(tmp_path / "a"), ep, "full", timeout_s=240)[0]
    first = spawn_gloo(_dist_run, 2, str(tmp_path), ep, "first", timeout_s=240)[0]
    resumed = spawn_gloo(_dist_run, 2, str(tmp_path), ep, "resume", timeout_s=240)[0]
    _compare(full, first, resumed)


def _save_after_two_steps(rank, world, tmp, ep):
    """Train 2 steps with ``ep`` and save; returns the full parameters and AdamW moments."""
    tmp = __import__("pathlib").Path(tmp)
    tr = Trainer(_cfg(tmp, ep))
    for s in range(2):
        tr.step(make_batch(100 + s))
    save_checkpoint(tmp / "ck", 2, tr, {"version": 2})
    return _params(tr)


def _load_latest(rank, world, tmp, ep):
    tmp = __import__("pathlib").Path(tmp)
    tr = Trainer(_cfg(tmp, ep))
    meta, _, _ = load_checkpoint(latest_checkpoint(tmp / "ck"), tr)
    assert tr.steps_done == 2 and meta["ep"] != ep
    return _params(tr)


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_written_with_ep2_loads_with_ep1_in_one_process(tmp_path):
    saved = spawn_gloo(_save_after_two_steps, 2, str(tmp_path), 2, timeout_s=240)
    _assert_same(saved[0], saved[1])
    loaded = _load_latest(0, 1, str(tmp_path), 1)
    _assert_same(saved[0], loaded)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_checkpoint_written_with_ep1_resumes_with_ep2(tmp_path):
    saved = spawn_gloo(_save_after_two_steps, 2, str(tmp_path), 1, timeout_s=400)[0]
    for loaded in spawn_gloo(_load_latest, 2, str(tmp_path), 2, timeout_s=400):
        _assert_same(saved, loaded)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_checkpoint_four_ranks_ep2_dp2_reshards_to_ep4_and_one_process(tmp_path):
    """Experts split over ep AND FSDP-sharded over dp_shard: the global offsets must still hold."""
    saved = spawn_gloo(_save_after_two_steps, 4, str(tmp_path), 2, timeout_s=600)[0]
    for loaded in spawn_gloo(_load_latest, 4, str(tmp_path), 4, timeout_s=600):
        _assert_same(saved, loaded)
    _assert_same(saved, _load_latest(0, 1, str(tmp_path), 1))


def test_save_refused_before_writing_when_the_disk_is_full(tmp_path, monkeypatch):
    """A disk too small for the model + optimizer: a clear ENOSPC naming the folder, no partial save left."""
    import errno
    import shutil

    import streamrl.learner.run_checkpoint as ckpt

    tr = Trainer(_cfg(tmp_path))
    save_checkpoint(tmp_path / "ck", 1, tr, {})
    real = shutil.disk_usage

    def nearly_full(path):  # what the OS reports on a disk with 1 MiB left
        return real(path)._replace(free=1 << 20)

    monkeypatch.setattr(ckpt.shutil, "disk_usage", nearly_full)
    with pytest.raises(OSError, match=r"checkpoint of step 2 needs ~.* GiB .* free in .*ck") as err:
        save_checkpoint(tmp_path / "ck", 2, tr, {})
    assert err.value.errno == errno.ENOSPC
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000001"]  # no .tmp_ folder left
    assert latest_checkpoint(tmp_path / "ck").name == "step_00000001"
