"""Sharded learner checkpoints with torch.distributed.checkpoint (DCP), and exact resume.

A checkpoint is a directory ``CKPT_DIR/step_00000012/`` holding

* the DCP shards (every rank writes its own part in parallel): all parameters, **all**
  experts, AdamW state (step, exp_avg, exp_avg_sq), the router EMA, the optimizer step count;
  with ``model.lora`` only the trained parameters (adapters, a value head) and their AdamW
  state: the frozen base is read again from ``model.path`` (``Trainer.checkpointed_parameters``);
* ``rng_rank{r}.safetensors`` + ``rng_rank{r}.json``: each rank's torch (CPU and CUDA) and
  Python RNG states;
* ``learner_state.json`` (rank 0): step, version, data cursors and counters the caller passes,
  plus the parallel layout it was written with;
* ``buffer.safetensors`` (rank 0, optional): the learner buffer's pending trajectories
  (packed) and the receiver's seen trajectory ids, so a resume loses and repeats nothing.

* ``config.json`` (rank 0): the run's full config, so ``streamrl-export`` and ``streamrl-eval``
  can rebuild the model from the checkpoint alone.

Every tensor is saved with its global shape: dense tensors are FSDP DTensors and routed
experts are described as DTensors ``[E, ...]`` over the ep x dp_shard mesh
(:func:`~streamrl.parallel.expert_parallel.global_expert_view`), so DCP writes each expert
once, with its offset, and reshards on load: a checkpoint written with ``ep = 2`` on 2 ranks
resumes with ``ep = 1`` or ``ep = 4`` and loads in one process. RNG streams are restored only
when the world size is the same (otherwise each rank keeps its fresh seed).

Writes go to a hidden temp directory renamed into place after a barrier, so a crash during a
save never leaves a half checkpoint that :func:`latest_checkpoint` would pick. A disk that
fills up (before or during the write) raises :class:`CheckpointDiskFull` on every rank alike
and removes the temp directory: the previous checkpoint stays the latest and loadable. Nothing
here unpickles: DCP metadata is read by torch, the rest is JSON and safetensors.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from tensordict import TensorDict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from streamrl.config import config_from_dict
from streamrl.parallel.expert_parallel import global_expert_view, is_expert_param

_PREFIX = "step_"
# 2: experts as global tensors (reshardable). 1 (no "format" key): per-ep-rank expert slices
# under "<name>@ep<i>of<ep>" keys, which only the same ep could read.
FORMAT = 2
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or incompatible with this run."""


# "disk full" and "quota exceeded": the errors a save may outlive (space can be freed meanwhile)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointDiskFull(OSError):
    """A checkpoint did not fit on its disk; nothing of it was left behind.

    Attributes: ``step``, ``root`` (the checkpoint directory), ``need`` (bytes of model and
    optimizer tensors, summed over ranks when the check ran before writing) and ``free`` (bytes).
    """

    def __init__(self, code: int, step: int, root: Path, need: int, free: int, why: str):
        super().__init__(code, f"checkpoint of step {step} needs ~{need / 2**30:.2f} GiB ({need} bytes of model and "
                               f"optimizer tensors, plus metadata), {free / 2**30:.2f} GiB ({free} bytes) free in "
                               f"{root}: {why}; free space there, set checkpoint.dir elsewhere or lower "
                               f"checkpoint.keep_last")
        self.step, self.root, self.need, self.free = step, Path(root), need, free


def disk_full_error(exc: BaseException) -> OSError | None:
    """The disk-full ``OSError`` behind ``exc``, or None.

    DCP wraps each rank's writer error in a :class:`CheckpointException`, and torch's zip writer
    turns ENOSPC into ``RuntimeError("unexpected pos ...")`` with the OSError as its context, so
    the cause is looked for through both.
    """
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        if isinstance(e, CheckpointException):
            todo.extend(failure for failure, _ in e.failures.values())
        todo.extend((e.__cause__, e.__context__))
    return None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _as_dtensor_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "device_mesh"):
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of this rank's part of the model and optimizer tensors in ``state``."""
    return sum(_local(t).numel() * _local(t).element_size() for t in state.values())


def _check_free_space(folder: Path, step: int, state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Refuse a save the disk cannot hold before writing any of it (every rank raises alike).

    A full disk otherwise fails deep in DCP's writer with "unexpected pos 704 vs 598" and leaves
    a partial folder. The estimate is the model and optimizer tensors of every rank; the RNG,
    buffer and metadata files are small next to them.
    """
    need, free = _local_bytes(state), shutil.disk_usage(folder).free
    if dist.is_initialized() and dist.get_world_size() > 1:  # tensors, not pickled objects, between ranks
        total = torch.tensor([float(need)], dtype=torch.float64, device=device)
        least = torch.tensor([float(free)], dtype=torch.float64, device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        need, free = int(total.item()), int(least.item())
    if need > free:
        raise CheckpointDiskFull(errno.ENOSPC, step, folder.parent, need, free, "refused before writing")


def _disk_now_full(exc: BaseException, folder: Path, state: dict[str, torch.Tensor]) -> OSError | None:
    """ENOSPC when a failed write left less room in ``folder`` than this rank's tensors need.

    Between initialised ranks DCP pickles each writer's error, which drops its context: a full
    disk then arrives as a bare ``RuntimeError("unexpected pos ...")``, so the disk is asked.
    """
    if not isinstance(exc, (Exception, CheckpointException)) or not folder.exists():
        return None  # an interrupt, or nothing was written
    if shutil.disk_usage(folder).free >= _local_bytes(state):
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _agreed_errno(code: int, device: torch.device) -> int:
    """The largest of every rank's ``code`` (0: no error), so that all ranks fail a save together."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return code
    t = torch.tensor([code], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _state(trainer) -> dict[str, torch.Tensor]:
    """The DCP state dict of the trainer; its tensors share storage with the live ones."""
    opt, mesh = trainer.optim, trainer.mesh
    state: dict[str, torch.Tensor] = {"meta.steps_done": torch.tensor([trainer.steps_done], dtype=torch.int64)}
    for name, p in trainer.checkpointed_parameters():
        view = (lambda t: global_expert_view(t, mesh)) if is_expert_param(name) else (lambda t: t)
        state[f"model.{name}"] = view(p)
        st = opt.state[p]
        if not st:  # fresh optimizer (before the first step, or on load): materialise zeros
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for sk in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{name}.{sk}"] = view(st[sk])
        state[f"optim.{name}.step"] = st["step"]
    for name, t in trainer.router.ema.items():
        p = dict(trainer.router.params)[name]
        state[f"router_ema.{name}"] = _as_dtensor_like(t, p.data)
    return state


def _live_tensors(trainer) -> dict[str, torch.Tensor]:
    """The local tensors :func:`_state` wraps, by the same keys (to copy loaded values into)."""
    out = {}
    for name, p in trainer.checkpointed_parameters():
        out[f"model.{name}"] = _local(p.data)
        st = trainer.optim.state[p]
        for sk in ("exp_avg", "exp_avg_sq", "step"):
            out[f"optim.{name}.{sk}"] = _local(st[sk])
    for name, t in trainer.router.ema.items():
        out[f"router_ema.{name}"] = t
    return out


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
    done = [d for d in root.iterdir()
            if d.is_dir() and d.name.startswith(_PREFIX) and (d / "learner_state.json").is_file()]
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
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp_{_PREFIX}{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    state = _state(trainer)
    try:
        _check_free_space(tmp, step, state, trainer.device)
        dcp.save(state, checkpoint_id=str(tmp))  # a writer error is raised on every rank (DCP gathers them)
        _write_rank_files(tmp, rank, step, trainer, learner_state, buffer_items, seen_ids, extra_tensors)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        full = disk_full_error(e) or _disk_now_full(e, tmp, state)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint stays the latest
        if full is None or isinstance(e, CheckpointDiskFull):
            raise
        raise CheckpointDiskFull(full.errno, step, root, _local_bytes(state), shutil.disk_usage(root).free,
                                 f"{full.strerror} while writing {tmp}") from e
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if keep_last:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _write_rank_files(tmp: Path, rank: int, step: int, trainer, learner_state, buffer_items, seen_ids,
                      extra_tensors) -> None:
    """This rank's RNG files and rank 0's buffer, extras, ``learner_state.json`` and config.

    The ranks agree on the outcome before returning: one rank's full disk fails the save on
    every rank, instead of leaving the others waiting at the next barrier.
    """
    error = None
    try:
        rng_t, rng_m = _rng_state()
        save_file(rng_t, str(tmp / f"rng_rank{rank}.safetensors"))
        (tmp / f"rng_rank{rank}.json").write_text(json.dumps(rng_m))
        if rank == 0:
            if buffer_items is not None or seen_ids:
                items = buffer_items.items() if buffer_items is not None else []
                tensors = {f"traj.{k}": v.contiguous() for k, v in items}
                tensors["seen_ids"] = torch.tensor(list(seen_ids or []), dtype=torch.int64)
                save_file(tensors, str(tmp / "buffer.safetensors"))
            if extra_tensors:
                save_file({k: v.contiguous() for k, v in extra_tensors.items()}, str(tmp / "extra.safetensors"))
            meta = {"step": step, "world": trainer.world, "ep": trainer.mesh.dims.ep, "format": FORMAT,
                    **(learner_state or {})}
            (tmp / "learner_state.json").write_text(json.dumps(meta, indent=1))
            (tmp / CONFIG_FILE).write_text(json.dumps(trainer.cfg.to_dict(), indent=1))
    except Exception as e:  # safetensors reports a full disk as its own error, the OSError as context
        error = e
    full = disk_full_error(error) if error is not None else None
    # EIO stands for any other error: a disk-full errno outranks it, so every rank reports disk full
    code = _agreed_errno(full.errno if full is not None else (errno.EIO if error is not None else 0), trainer.device)
    if error is not None:
        raise error
    if code:
        raise OSError(code, f"another learner rank failed writing {tmp}")


def load_checkpoint(path: Path, trainer) -> tuple[dict[str, Any], Any, list[int]]:
    """Load in place on every rank (collective).

    Returns:
        (learner_state dict, pending trajectories TensorDict or None, seen trajectory ids).
    """
    path = Path(path)
    meta = read_learner_state(path)
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    trainer.steps_done = int(state["meta.steps_done"][0])
    # DCP loads into the wrapped local tensors in place; copy where it handed back new ones.
    for k, live in _live_tensors(trainer).items():
        loaded = _local(state[k])
        if loaded.data_ptr() != live.data_ptr():
            live.copy_(loaded)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_rank{rank}.safetensors"
    if rng_file.is_file() and meta.get("world") == trainer.world:  # restore this rank's streams exactly
        _set_rng_state(load_file(str(rng_file)), json.loads((path / f"rng_rank{rank}.json").read_text()))
    items, seen = None, []
    buf = path / "buffer.safetensors"
    if rank == 0 and buf.is_file():
        t = load_file(str(buf))
        seen = t.pop("seen_ids").tolist()
        if t:
            items = TensorDict({k[len("traj."):]: v for k, v in t.items()}, batch_size=[])
    return meta, items, seen


def read_learner_state(path: Path) -> dict[str, Any]:
    """``learner_state.json`` of a complete checkpoint in the reshardable format, or CheckpointError."""
    path = Path(path)
    meta_file = path / "learner_state.json"
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete or missing (no learner_state.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format", 1) < FORMAT and meta.get("ep", 1) > 1:
        raise CheckpointError(f"checkpoint {str(path)!r} holds per-rank expert slices (learner.ep = {meta['ep']}, "
                              f"an older StreamRL format); it cannot be resharded or exported")
    return meta


def read_run_config(path: Path):
    """The run :class:`~streamrl.config.Config` stored in a checkpoint, or None (older checkpoints)."""
    f = Path(path) / CONFIG_FILE
    return config_from_dict(json.loads(f.read_text())) if f.is_file() else None


def load_extra(path: Path) -> dict[str, torch.Tensor]:
    """The ``extra_tensors`` a checkpoint was saved with ({} if none)."""
    f = Path(path) / "extra.safetensors"
    return load_file(str(f)) if f.is_file() else {}
