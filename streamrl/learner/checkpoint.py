"""Sharded learner checkpoints with torch.distributed.checkpoint (DCP), and exact resume.

A checkpoint is a directory ``CKPT_DIR/step_00000012/`` holding

* the DCP shards (every rank writes its own part in parallel): all parameters, **all**
  experts, AdamW state (step, exp_avg, exp_avg_sq), the router EMA, the optimizer step count;
* ``rng_rank{r}.safetensors`` + ``rng_rank{r}.json``: each rank's torch (CPU and CUDA) and
  Python RNG states;
* ``learner_state.json`` (rank 0): step, version, data cursors and counters the caller passes,
  plus the parallel layout it was written with;
* ``buffer.safetensors`` (rank 0, optional): the learner buffer's pending trajectories
  (packed) and the receiver's seen trajectory ids, so a resume loses and repeats nothing.

Expert tensors are local slices ``[E / ep, ...]`` of this rank's ep group; each slice is saved
under its own key (``<name>@ep<i>of<ep>``) by the ranks that hold it, so every expert is saved
exactly once and a resume needs the same ``ep`` (checked, with a clear error). Dense tensors
are FSDP DTensors and reshard freely across world sizes.

Writes go to a hidden temp directory renamed into place after a barrier, so a crash during a
save never leaves a half checkpoint that :func:`latest_checkpoint` would pick. Nothing here
unpickles: DCP metadata is read by torch, the rest is JSON and safetensors.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from streamrl.parallel.expert_parallel import is_expert_param

_PREFIX = "step_"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or incompatible with this run."""


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _key(name: str, trainer) -> str:
    ep = trainer.mesh.dims.ep
    return f"{name}@ep{trainer.mesh.ep_rank}of{ep}" if ep > 1 and is_expert_param(name) else name


def _as_dtensor_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return t


def _state(trainer) -> dict[str, torch.Tensor]:
    """The DCP state dict of the trainer; tensors are the live ones (load works in place)."""
    opt = trainer.optim
    state: dict[str, torch.Tensor] = {"meta.steps_done": torch.tensor([trainer.steps_done], dtype=torch.int64)}
    for name, p in trainer.model.named_parameters():
        k = _key(name, trainer)
        state[f"model.{k}"] = p
        st = opt.state[p]
        if not st:  # fresh optimizer (before the first step, or on load): materialise zeros
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for sk in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{k}.{sk}"] = st[sk]
        state[f"optim.{k}.step"] = st["step"]
    for name, t in trainer.router.ema.items():
        p = dict(trainer.router.params)[name]
        state[f"router_ema.{name}"] = _as_dtensor_like(t, p.data)
    return state


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    v, internal, gauss = random.getstate()
    return tensors, {"python": [v, list(internal), gauss]}


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    v, internal, gauss = meta["python"]
    random.setstate((v, tuple(internal), gauss))


def checkpoint_dir(cfg) -> Path:
    """Where checkpoints of this run live (``checkpoint.dir`` or ``RUN_DIR/checkpoints``)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.run_dir) / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    done = [d for d in root.iterdir() if d.is_dir() and d.name.startswith(_PREFIX) and (d / "learner_state.json").is_file()]
    return sorted(done, key=lambda d: int(d.name[len(_PREFIX):]))


def latest_checkpoint(root: Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def save_checkpoint(root: Path, step: int, trainer, learner_state: dict[str, Any] | None = None,
                    buffer_items=None, seen_ids: list[int] | None = None, keep_last: int | None = None,
                    extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Save on every rank (collective). Returns the final directory.

    Args:
        learner_state: JSON-able cursors and counters (rank 0's copy is written).
        buffer_items: packed TensorDict of pending trajectories (rank 0), or None.
        seen_ids: the receiver's deduplication window (rank 0), or None.
        keep_last: delete older checkpoints beyond this many.
        extra_tensors: more rank-0 tensors (e.g. the ledger's trained ids), read back with
            :func:`load_extra`.
    """
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp_{_PREFIX}{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(_state(trainer), checkpoint_id=str(tmp))
    rng_t, rng_m = _rng_state()
    save_file(rng_t, str(tmp / f"rng_rank{rank}.safetensors"))
    (tmp / f"rng_rank{rank}.json").write_text(json.dumps(rng_m))
    if rank == 0:
        if buffer_items is not None or seen_ids:
            tensors = {f"traj.{k}": v.contiguous() for k, v in (buffer_items.items() if buffer_items is not None else [])}
            tensors["seen_ids"] = torch.tensor(list(seen_ids or []), dtype=torch.int64)
            save_file(tensors, str(tmp / "buffer.safetensors"))
        if extra_tensors:
            save_file({k: v.contiguous() for k, v in extra_tensors.items()}, str(tmp / "extra.safetensors"))
        meta = {"step": step, "world": trainer.world, "ep": trainer.mesh.dims.ep, **(learner_state or {})}
        (tmp / "learner_state.json").write_text(json.dumps(meta, indent=1))
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep_last:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, trainer) -> tuple[dict[str, Any], Any, list[int]]:
    """Load in place on every rank (collective).

    Returns:
        (learner_state dict, pending trajectories TensorDict or None, seen trajectory ids).
    """
    import torch.distributed.checkpoint as dcp
    from tensordict import TensorDict

    path = Path(path)
    meta_file = path / "learner_state.json"
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete or missing (no learner_state.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("ep", 1) != trainer.mesh.dims.ep:
        raise CheckpointError(f"checkpoint {str(path)!r} was written with learner.ep = {meta.get('ep')}, "
                              f"this run has learner.ep = {trainer.mesh.dims.ep}; resume with the same ep")
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    trainer.steps_done = int(state["meta.steps_done"][0])
    for name, t in trainer.router.ema.items():
        loaded = state[f"router_ema.{name}"]
        t.copy_(loaded.to_local() if hasattr(loaded, "to_local") else loaded)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_rank{rank}.safetensors"
    if rng_file.is_file():  # same world size: restore this rank's streams exactly
        _set_rng_state(load_file(str(rng_file)), json.loads((path / f"rng_rank{rank}.json").read_text()))
    items, seen = None, []
    buf = path / "buffer.safetensors"
    if rank == 0 and buf.is_file():
        t = load_file(str(buf))
        seen = t.pop("seen_ids").tolist()
        if t:
            items = TensorDict({k[len("traj."):]: v for k, v in t.items()}, batch_size=[])
    return meta, items, seen


def load_extra(path: Path) -> dict[str, torch.Tensor]:
    """The ``extra_tensors`` a checkpoint was saved with ({} if none)."""
    f = Path(path) / "extra.safetensors"
    return load_file(str(f)) if f.is_file() else {}
