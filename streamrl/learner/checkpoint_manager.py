"""One checkpointer over the learner's stateful parts (torchtitan's ``CheckpointManager`` idea).

The learner registers its parts by name: the trainer (model, optimizer, router EMA: saved by
:func:`streamrl.learner.run_checkpoint.save_checkpoint` itself, collectively), the run's progress
(:class:`RunProgress`) and rank 0's :class:`~streamrl.learner.intake.Intake`. Each part has
``state_dict()`` / ``load_state_dict()``; a part's state is JSON values plus tensors. The
checkpointer files them where ``save_checkpoint`` keeps them: JSON in ``learner_state.json``
under the part's name, tensors in the rank-0 extras as ``<part>.<key>``, and the one packed
trajectory batch (the intake's ``buffer_items``) as the checkpoint's buffer.

``maybe_save(step)`` is the loop's one call; it is also where exports of plain Hugging Face
folders go (``checkpoint.hf_interval``), next to the DCP save.

A save or export that does not fit on its disk does not stop the run: it is logged as an error
naming the folder, the bytes needed and free and the knobs, counted in ``failures`` (the
learner's ``learner/checkpoint_failures`` metric), and training goes on. The previous
checkpoint stays the latest, and the intake's journal keeps what it does not cover, so a crash
meanwhile still resumes without loss; the next save on the grid tries again.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from streamrl.export import write_step_folder
from streamrl.learner.run_checkpoint import (CheckpointDiskFull, checkpoint_dir, disk_full_error, latest_checkpoint,
                                             load_checkpoint, load_extra, save_checkpoint)

log = logging.getLogger(__name__)
BUFFER_KEY = "buffer_items"  # the part key filed as the checkpoint's packed trajectory buffer


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RunProgress:
    """Where the run is: step, policy version, trajectories trained, per-step mean rewards."""

    step: int = 0
    version: int = 0
    samples: int = 0
    rewards: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "samples": self.samples, "rewards": list(self.rewards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.version = int(state["step"]), int(state["version"])
        self.samples, self.rewards = int(state.get("samples", 0)), [float(r) for r in state.get("rewards", [])]


class Checkpointer:
    """Saves and restores the trainer plus named :class:`Stateful` parts (collective calls).

    Args:
        cfg: the run config (``checkpoint.*``).
        trainer: the learner's trainer (saved sharded by every rank).
        parts: name -> stateful part on this rank (rank 0 holds the intake; other ranks pass None).
    """

    def __init__(self, cfg, trainer, parts: dict[str, Stateful | None]):
        self.cfg, self.trainer = cfg.checkpoint, trainer
        self.root = checkpoint_dir(cfg)
        self.parts = {k: v for k, v in parts.items() if v is not None}
        self.last_saved: int | None = None
        self.failures = 0  # saves and exports that did not fit on their disk

    def maybe_save(self, step: int) -> Path | None:
        """Save when ``step`` is on the ``checkpoint.save_interval`` grid, and write an HF folder on the
        ``checkpoint.hf_interval`` grid (call after each step's bookkeeping, so the saved counters
        include it)."""
        if self.cfg.hf_interval and step % self.cfg.hf_interval == 0:
            self._export(step)
        if self.cfg.save_interval and step % self.cfg.save_interval == 0:
            return self.save(step)
        return None

    def save_on_stop(self, step: int) -> Path | None:
        """The final save of a clean stop (``checkpoint.save_on_stop``), unless ``step`` is saved."""
        if not self.cfg.save_on_stop or step == 0:
            return None
        if not (self.cfg.hf_interval and step % self.cfg.hf_interval == 0):  # else maybe_save wrote it
            self._export(step)  # the run's model out, next to its last DCP save
        return self.save(step) if self.last_saved != step else None

    def _export(self, step: int) -> None:
        """The HF folder of ``step``; a full disk is logged and counted like a failed save."""
        try:
            write_step_folder(self.trainer, step)
        except Exception as e:  # safetensors reports a full disk as its own error, the OSError as context
            if disk_full_error(e) is None:
                raise
            self.failures += 1
            log.error("HF folder of step %d not written: %s (checkpoint.dir = %s); training goes on "
                      "(learner/checkpoint_failures = %d)", step, e, self.root, self.failures)

    def save(self, step: int) -> Path | None:
        """Save ``step`` (collective). None when it did not fit on the disk: logged, counted in
        ``failures``, the previous checkpoint kept as the latest, training goes on."""
        try:
            path = self._save(step)
        except CheckpointDiskFull as e:
            self.failures += 1
            log.error("%s. The latest checkpoint stays %s; training goes on (learner/checkpoint_failures = %d)",
                      e, latest_checkpoint(self.root) or "none", self.failures)
            return None
        self.last_saved = step
        for part in self.parts.values():
            if hasattr(part, "on_checkpoint"):
                part.on_checkpoint(step)  # e.g. the intake's journal drops what this save covers
        return path

    def _save(self, step: int) -> Path:
        """Split the parts' states into JSON, tensors and the buffer, and write the checkpoint."""
        learner_state: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        items = None
        for name, part in self.parts.items():
            state = part.state_dict()
            if BUFFER_KEY in state:
                items = state.pop(BUFFER_KEY)
            for key in [k for k, v in state.items() if isinstance(v, torch.Tensor)]:
                tensors[f"{name}.{key}"] = state.pop(key)
            learner_state[name] = state
        return save_checkpoint(self.root, step, self.trainer, learner_state, buffer_items=items,
                               keep_last=self.cfg.keep_last, extra_tensors=tensors or None)

    def find(self, resume: str) -> Path | None:
        """``resume``: a checkpoint directory, or ``latest`` (None if there is none yet)."""
        return latest_checkpoint(self.root) if resume == "latest" else Path(resume)

    def restore(self, path: Path) -> dict[str, Any]:
        """Load the trainer and every part from ``path`` (collective); returns learner_state.json."""
        state, items, _ = load_checkpoint(path, self.trainer)
        extra = load_extra(path)
        for name, part in self.parts.items():
            part_state = dict(state.get(name, {}))
            prefix = f"{name}."
            part_state.update({k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)})
            part_state.setdefault(BUFFER_KEY, items)
            part.load_state_dict(part_state)
        log.info("restored %s (step %s)", path, state.get("step"))
        return state
