"""A checkpoint disk that fills up: the save fails named and counted, the previous checkpoint stays
the latest and loadable, and the run goes on.

The unit tests (default tier) fake ENOSPC where the writers raise it; the chaos test fills a real
tmpfs under a real run. The run's checkpoint directory is a small tmpfs the test mounts
(``mount -t tmpfs``, root only; skipped with the reason otherwise).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

import streamrl.learner.run_checkpoint as run_checkpoint
from streamrl.config import load_config
from streamrl.learner.checkpoint_manager import Checkpointer, RunProgress
from streamrl.learner.run_checkpoint import CheckpointDiskFull, latest_checkpoint, load_checkpoint
from streamrl.learner.trainer import Trainer

from .conftest import REPO, check_consistent, fault_line, wait_for

KNOBS = "set checkpoint.dir elsewhere or lower checkpoint.keep_last"


class _Journal:
    """Stands in for the intake: records which saves told it that it may drop its journal."""

    def __init__(self):
        self.covered: list[int] = []

    def state_dict(self) -> dict:
        return {"n": len(self.covered)}

    def load_state_dict(self, state: dict) -> None:
        pass

    def on_checkpoint(self, step: int) -> None:
        self.covered.append(step)


def _checkpointer(tmp_path: Path) -> tuple[Checkpointer, RunProgress, _Journal]:
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"run.run_dir={tmp_path}", "checkpoint.keep_last=1"])
    run, journal = RunProgress(), _Journal()
    return Checkpointer(cfg, Trainer(cfg), {"run": run, "journal": journal}), run, journal


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_while_writing_keeps_the_previous_checkpoint_and_counts(tmp_path, monkeypatch, caplog):
    """ENOSPC from the writer after DCP wrote its shards: no half checkpoint, the last one loads."""
    ckpt, run, journal = _checkpointer(tmp_path)
    run.step = 4
    assert ckpt.save(4).name == "step_00000004"
    monkeypatch.setattr(run_checkpoint, "save_file", _enospc)  # the RNG / buffer / extras writer
    run.step = 8
    with caplog.at_level(logging.ERROR):
        assert ckpt.save(8) is None
    assert ckpt.failures == 1 and ckpt.last_saved == 4 and journal.covered == [4]  # the journal still covers 5-8
    msg = caplog.text
    assert "checkpoint of step 8 needs ~" in msg and " bytes of model and optimizer tensors" in msg
    assert " bytes) free in " in msg
    assert str(ckpt.root) in msg and "No space left on device while writing" in msg and KNOBS in msg
    assert "The latest checkpoint stays " in msg and "step_00000004" in msg and "learner/checkpoint_failures = 1" in msg
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000004"]  # no .tmp_ folder left
    state, _, _ = load_checkpoint(latest_checkpoint(ckpt.root), ckpt.trainer)
    assert state["step"] == 4 and state["run"]["step"] == 4
    monkeypatch.undo()  # space freed: the next save on the grid succeeds and replaces it
    run.step = 12
    assert ckpt.save(12).name == "step_00000012" and journal.covered == [4, 12]
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000012"]


def test_dcp_writer_disk_full_is_named_and_other_errors_propagate(tmp_path, monkeypatch):
    """DCP reports a full disk per rank inside a CheckpointException, torch's zip writer as
    "unexpected pos" with the OSError as its context: both are recognised; anything else is raised."""
    ckpt, run, _ = _checkpointer(tmp_path)

    def dcp_disk_full(*args, **kwargs):
        try:
            try:
                _enospc()
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        except RuntimeError as e:
            raise CheckpointException("write", {0: (e, None)})

    monkeypatch.setattr(run_checkpoint.dcp, "save", dcp_disk_full)
    with pytest.raises(CheckpointDiskFull, match="checkpoint of step 3 needs .* free in .*checkpoints") as err:
        run_checkpoint.save_checkpoint(ckpt.root, 3, ckpt.trainer, {})
    assert err.value.errno == errno.ENOSPC and err.value.step == 3 and err.value.need > 0
    assert ckpt.save(3) is None and ckpt.failures == 1

    # Between ranks DCP pickles the error and its context is lost: the disk, now full, tells
    def dcp_cause_lost(*args, **kwargs):
        raise CheckpointException("write", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})

    real, asked = shutil.disk_usage, []

    def full_after_the_check(path):  # the check before writing passes; the write filled the disk
        asked.append(path)
        return real(path) if len(asked) == 1 else real(path)._replace(free=4096)

    monkeypatch.setattr(run_checkpoint.dcp, "save", dcp_cause_lost)
    monkeypatch.setattr(run_checkpoint.shutil, "disk_usage", full_after_the_check)
    assert ckpt.save(3) is None and ckpt.failures == 2
    monkeypatch.setattr(run_checkpoint.shutil, "disk_usage", real)  # room left: that error is not a full disk
    with pytest.raises(CheckpointException):
        ckpt.save(3)
    monkeypatch.setattr(run_checkpoint.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "no")))
    with pytest.raises(PermissionError):  # not a full disk: the run fails as before
        ckpt.save(3)
    assert list(ckpt.root.iterdir()) == []


# -- chaos: a real run whose checkpoint directory is a tmpfs that fills up --------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs mounted where ``launch`` keeps the run's checkpoints (skipped where mounting
    is not permitted); request it before ``launch`` so that it is unmounted after the run stopped."""
    where = tmp_path / "run" / "checkpoints"
    where.mkdir(parents=True)
    if shutil.which("mount") is None:
        pytest.skip("mount is not installed")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True,
                       text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _fill(disk: Path, leave_bytes: int) -> Path:
    """Fill ``disk`` until ``leave_bytes`` are free, with a file this test owns (appended to when
    called again)."""
    filler = disk / "filler"
    left = shutil.disk_usage(disk).free - leave_bytes
    with filler.open("ab") as f:
        chunk = b"\0" * (1 << 20)
        try:
            while left > 0:
                left -= f.write(chunk[:left])
        except OSError as e:  # a save running meanwhile took the rest: full is what we want
            if e.errno != errno.ENOSPC:
                raise
    return filler


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_checkpoint_disk_full_mid_run_is_named_counted_and_the_run_goes_on(small_disk, launch):
    """Deadline 300 s. The checkpoint tmpfs is filled after the first checkpoint: the next saves
    fail named (path, bytes, knob) and counted, the previous checkpoint stays the latest and loads,
    the learner keeps training; once space is freed a save succeeds and the run completes."""
    steps = 100  # ~0.2 s a step: room for two failed saves (every 4 steps) and one after space is freed
    run = launch(steps=steps, extra=["checkpoint.keep_last=1"])
    wait_for(lambda: run.latest_checkpoint_step() >= 4, 200, "the first checkpoint")
    assert run.proc.poll() is None and run.steps() < steps - 12, "run ended before the fault could be injected"
    # Less room than one checkpoint takes but more than its tensors' bytes: the check before
    # writing passes and the write itself hits ENOSPC, until the growing journal (KiB per step,
    # kept while no save succeeds) makes the check refuse too.
    leave = _bytes(latest_checkpoint(small_disk)) - (128 << 10)
    filler = _fill(small_disk, leave)
    t0 = time.monotonic()
    learner_log = run.run_dir / "logs" / "learner.log"

    def two_failed_saves() -> bool:
        # A save that was writing while the disk filled can still complete and then drop the
        # checkpoint before it (keep_last 1), freeing a whole checkpoint's room: fill that too.
        if shutil.disk_usage(small_disk).free > leave:
            _fill(small_disk, leave)
        return "learner/checkpoint_failures = 2" in learner_log.read_text()

    wait_for(two_failed_saves, 120, "two failed saves")
    detected = time.monotonic() - t0
    failed = [int(m) for m in re.findall(r"checkpoint of step (\d+) needs", learner_log.read_text())]
    kept = run.latest_checkpoint_step()  # a save that was running while the disk filled may have made it
    assert 4 <= kept < min(failed) and run.proc.poll() is None, (kept, failed)  # still training
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"run.run_dir={run.run_dir}"])
    state, _, _ = load_checkpoint(latest_checkpoint(small_disk), Trainer(cfg))
    assert state["step"] == kept  # the previous checkpoint stays loadable
    filler.unlink()  # space freed: the next save on the grid succeeds
    wait_for(lambda: run.latest_checkpoint_step() > max(failed), 120, "a checkpoint after space was freed")
    recovered = time.monotonic() - t0
    assert run.wait(200) == 0
    s = check_consistent(run, steps)  # the final checkpoint, in the tmpfs, loads at the exact step
    assert set(s["accounting"]["lost"]) <= {"stale"}, s["accounting"]["lost"]
    log = learner_log.read_text()
    assert f"free in {small_disk}" in log and KNOBS in log and "The latest checkpoint stays" in log
    failures = [json.loads(line).get("learner/checkpoint_failures", 0)
                for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert failures[-1] == log.count("learner/checkpoint_failures =") >= 2
    fault_line("checkpoint disk full", detected, recovered, s, failed_saves=failures[-1],
               refused_before_writing=log.count("refused before writing"),
               failed_while_writing=log.count("No space left on device while writing"))
