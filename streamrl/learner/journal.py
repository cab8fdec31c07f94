"""Write-ahead journal of accepted trajectories: what a checkpoint does not yet hold survives a crash.

A checkpoint holds the buffer and the dedup set *at its step*. Everything the learner accepts
afterwards lives only in memory until the next checkpoint, and a SIGKILL would lose it (the
workers already got their credit back and will not resend). So rank 0 appends every accepted
trajectory batch to a journal segment before it enters the buffer; ``--resume`` loads the
checkpoint and replays the journal segments written after it, skipping ids the checkpoint
already saw. Trajectories trained after the checkpoint and before the crash are replayed
too: their training was rolled back with the model, so they are trained once in the lineage
that survives.

Layout: ``CKPT_DIR/journal/after_<step:08d>_<incarnation:04d>/<n:08d>.safetensors``, one file
per accepted batch (the packed trajectory tensors, safetensors: no pickle), written to a temp
name and renamed, so a crash mid-write leaves no half entry. No fsync: the journal protects
against the *process* dying (page cache survives that), not against the host losing power.
Segments older than the newest complete checkpoint are deleted when a checkpoint completes.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tensordict import TensorDict

log = logging.getLogger(__name__)


def _segment_key(p: Path) -> tuple[int, int] | None:
    parts = p.name.split("_")
    if len(parts) != 3 or parts[0] != "after" or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return int(parts[1]), int(parts[2])


class Journal:
    """Append-only journal of one learner incarnation (rank 0 only).

    Args:
        root: the checkpoint directory (the journal lives in ``root/journal``).
        after_step: step of the checkpoint this incarnation resumed from (0 for a fresh start).
    """

    def __init__(self, root: Path, after_step: int):
        self.dir = Path(root) / "journal"
        self.dir.mkdir(parents=True, exist_ok=True)
        segs = self.segments()
        self.incarnation = 1 + max((_segment_key(s)[1] for s in segs), default=-1)
        self.entries = 0
        self.bytes = 0
        self.unreadable = 0  # entries :meth:`replay` had to skip (counted as lost by the caller)
        self._open(after_step)

    def segments(self) -> list[Path]:
        """Every segment, oldest first (by checkpoint step, then incarnation)."""
        segs = [p for p in self.dir.iterdir() if p.is_dir() and _segment_key(p) is not None]
        return sorted(segs, key=_segment_key)

    def _open(self, step: int) -> None:
        self.segment = self.dir / f"after_{step:08d}_{self.incarnation:04d}"
        self.segment.mkdir(parents=True, exist_ok=True)
        self._n = 0

    def append(self, td: TensorDict) -> None:
        """Persist one accepted batch (packed trajectory tensors) before it is used."""
        tensors = {k: v.contiguous() for k, v in td.items()}
        tmp = self.segment / f".{self._n:08d}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.segment / f"{self._n:08d}.safetensors")
        self._n += 1
        self.entries += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def rotate(self, step: int) -> None:
        """A checkpoint at ``step`` completed: start a new segment and drop the covered ones."""
        self._open(step)
        for seg in self.segments():
            if _segment_key(seg)[0] < step:
                shutil.rmtree(seg, ignore_errors=True)

    def replay(self, from_step: int) -> Iterator[TensorDict]:
        """Batches journaled after the checkpoint at ``from_step`` (all earlier incarnations), in
        order. An unreadable entry (disk trouble) is logged and skipped; the caller counts it."""
        for seg in self.segments():
            key = _segment_key(seg)
            if key[0] < from_step or seg == self.segment:
                continue
            for f in sorted(seg.glob("[0-9]*.safetensors")):
                try:
                    yield TensorDict(load_file(str(f)), batch_size=[])
                except (SafetensorError, OSError, ValueError) as e:
                    log.error("journal entry %s unreadable (%s); its trajectories are lost", f, e)
                    self.unreadable += 1
