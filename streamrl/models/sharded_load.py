"""Start big models without any rank holding the whole model: build on meta, shard, load shards.

``model.load = sharded`` (the default for an HF folder) runs, on every learner rank::

    build_empty_model(folder)          parameters on the meta device (no memory), buffers real
    ─► parallelize(...)                MoE blocks converted, EP + FSDP2 applied on meta
    ─► materialize_and_load(...)       to_empty(device), then each rank reads ONLY its rows of
                                       every tensor from the safetensors files (safe_open slices)

A parameter FSDP2 sharded is a DTensor ``Shard(0)`` over its mesh: the rank reads the rows of
its local shard. A routed-expert tensor holds ``E / ep`` experts per rank (then FSDP-sharded
over ``dp_shard``): the rank reads its experts' rows only, converting the checkpoint's layout
(HF per-expert ``experts.{e}.gate_proj / up_proj / down_proj``, Mixtral's ``w1 / w3 / w2``
under ``block_sparse_moe``, or an already fused ``experts.gate_up_proj [E, 2I, H]``) into ours
(the same conversion transformers applies on load, see ``transformers.conversion_mapping``).

Why not ``torch.distributed.checkpoint.hf_storage``: its reader maps checkpoint keys 1:1 onto
state-dict keys, so it cannot assemble our fused, ep-sliced expert tensors from per-expert
keys; a DCP checkpoint of the learner (``streamrl.learner.run_checkpoint``) already loads into the
sharded state dict and needs nothing from here.

Buffers (rotary ``inv_freq``) are not in safetensors: :func:`params_on_meta` puts only
parameters on meta, so buffers are computed for real at construction and survive
:func:`materialize_and_load`. Tied parameters (SmolLM2's ``lm_head`` = ``embed_tokens``) stay
one tensor: ``to_empty`` runs with ``swap_module_params_on_conversion`` so every parameter
keeps its identity.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM

from streamrl.models.families import check_converted_logits, probe_ids, reference_logits
from streamrl.models.moe import convert_moe_blocks, is_expert_param

log = logging.getLogger(__name__)

# Set on a model built by build_empty_model: the folder parallelize() loads its shards from.
WEIGHTS_FOLDER_ATTR = "streamrl_weights_folder"

# The checkpoint names of expert e's (gate, up, down) weights under an MoE block prefix
# ("model.layers.3.mlp"), per family; Mixtral keeps its original module names.
_EXPERT_KEYS = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
_DEFAULT_EXPERT_KEYS = ("mlp", "gate_proj", "up_proj", "down_proj")


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers goes to the meta device (no
    storage, no init cost); buffers stay on CPU so non-persistent ones (rotary ``inv_freq``)
    are computed exactly as in a normal construction."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_empty_model(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The HF causal LM of ``folder`` with its parameters on the meta device (see module doc)."""
    config = AutoConfig.from_pretrained(folder)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    setattr(model, WEIGHTS_FOLDER_ATTR, Path(folder))
    return model


def has_meta_params(model: nn.Module) -> bool:
    """True while any parameter of ``model`` has no storage yet."""
    return any(p.device.type == "meta" for p in model.parameters())


def model_bytes(model: nn.Module, ep: int = 1) -> int:
    """Bytes of the whole (global) model's parameters; routed experts counted ``ep`` times
    (a rank holds ``1 / ep`` of them)."""
    return sum(p.numel() * p.element_size() * (ep if is_expert_param(n) else 1) for n, p in model.named_parameters())


class SafetensorsFolder:
    """Read rows of tensors from an HF folder's safetensors files without loading them whole."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        else:
            files = {}
            for f in sorted(self.folder.glob("*.safetensors")):
                with safe_open(f, "pt") as s:
                    files.update(dict.fromkeys(s.keys(), f.name))
        if not files:
            raise ValueError(f"model folder {str(self.folder)!r} has no safetensors weights")
        self.key_file = files

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def _read(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        # Opened per read: safetensors maps the file, and every page a mapping has touched counts
        # in the process's resident memory until it is unmapped; closing after each tensor keeps
        # a rank's footprint at its own shards instead of its shards twice.
        with safe_open(self.folder / self.key_file[key], "pt") as f:
            sl = f.get_slice(key)
            if lo is None or not sl.get_shape():
                return sl[:].clone()
            return sl[lo:hi].clone()

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the first dimension of tensor ``key`` (a 0-d tensor whole)."""
        return self._read(key, lo, hi)

    def whole(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (one expert's matrix: small next to the model)."""
        return self._read(key)


def _row_range(t: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) rows of the parameter's global tensor that this rank's local tensor holds."""
    if not isinstance(t, DTensor):
        return 0, t.shape[0] if t.dim() else 0
    for pl in t.placements:
        assert isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0), t.placements
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return (offset[0], offset[0] + shape[0]) if t.dim() else (0, 0)


def _expert_rows(ckpt: SafetensorsFolder, family: str, name: str, lo: int, hi: int) -> torch.Tensor | None:
    """Experts ``[lo, hi)`` of our fused ``...experts.gate_up_proj`` [E, 2I, H] or
    ``...experts.down_proj`` [E, H, I], from a fused or a per-expert checkpoint (None if empty:
    a rank FSDP gave no experts)."""
    if hi <= lo:
        return None
    if name in ckpt:
        return ckpt.rows(name, lo, hi)
    block, which = name.rsplit(".experts.", 1)
    parent = block.rsplit(".", 1)[0]  # model.layers.3
    module, gate, up, down = _EXPERT_KEYS.get(family, _DEFAULT_EXPERT_KEYS)
    key = f"{parent}.{module}.experts.{{}}.{{}}.weight"
    if key.format(lo, down) not in ckpt:
        raise ValueError(f"model folder {str(ckpt.folder)!r}: no weights for {name} (neither a fused tensor "
                         f"nor per-expert {key.format(lo, down)!r})")
    if which == "down_proj":
        return torch.stack([ckpt.whole(key.format(e, down)) for e in range(lo, hi)])
    return torch.stack([torch.cat([ckpt.whole(key.format(e, gate)), ckpt.whole(key.format(e, up))])
                        for e in range(lo, hi)])


def _checkpoint_key(ckpt: SafetensorsFolder, family: str, name: str) -> str | None:
    """The checkpoint's key for our (transformers') tensor ``name``, or None."""
    for key in (name, name.replace(".mlp.", f".{_EXPERT_KEYS.get(family, _DEFAULT_EXPERT_KEYS)[0]}.", 1)):
        if key in ckpt:
            return key
    return None


def _dense_rows(ckpt: SafetensorsFolder, family: str, name: str, lo: int, hi: int) -> torch.Tensor:
    key = _checkpoint_key(ckpt, family, name)
    if key is None:
        raise ValueError(f"model folder {str(ckpt.folder)!r} has no tensor {name!r}")
    return ckpt.rows(key, lo, hi)


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of the buffers a state dict / checkpoint holds (DeepSeek's
    ``e_score_correction_bias``), not the derived ones (rotary ``inv_freq``)."""
    for mod_name, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield f"{mod_name}.{name}" if mod_name else name, b


@torch.no_grad()
def materialize_and_load(model: nn.Module, folder: Path, device: torch.device, ep_rank: int = 0,
                         n_local_experts: int = 0) -> int:
    """Give the meta parameters of a (converted, sharded) model storage on ``device`` and
    fill this rank's part of each from the safetensors of ``folder``. Returns bytes read.

    Parameters that already had storage (a value head attached after :func:`build_empty_model`)
    keep their values; buffers keep theirs unless the checkpoint holds them (persistent ones).
    ``ep_rank`` / ``n_local_experts``: this rank's experts are
    ``[ep_rank * n_local, (ep_rank + 1) * n_local)`` of the checkpoint's.
    """
    kept = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in model.named_parameters() if p.device.type != "meta"}
    meta = {n for n, p in model.named_parameters() if p.device.type == "meta"}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # tied params stay one tensor
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for n, b in buffers.items():
        model.get_buffer(n).copy_(b)
    ckpt = SafetensorsFolder(folder)
    family = str(getattr(model.config, "model_type", ""))
    for name, b in _persistent_buffers(model):  # small, replicated: read whole when saved
        key = _checkpoint_key(ckpt, family, name)
        if key is not None:
            b.copy_(ckpt.whole(key))
    read = 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if name in kept:
            local.copy_(kept[name])
            continue
        assert name in meta
        lo, hi = _row_range(p)
        if is_expert_param(name):
            off = ep_rank * n_local_experts
            part = _expert_rows(ckpt, family, name, lo + off, hi + off)
        else:
            part = _dense_rows(ckpt, family, name, lo, hi)
        if part is None or local.numel() == 0:
            continue
        if tuple(part.shape) != tuple(local.shape):
            raise ValueError(f"model folder {str(folder)!r}: {name} rows [{lo}, {hi}) have shape "
                             f"{tuple(part.shape)}, the model expects {tuple(local.shape)}")
        local.copy_(part)
        read += part.numel() * part.element_size()
    return read


def check_conversion_on_copy(folder: Path, dtype: torch.dtype, max_bytes: int, size: int) -> float | None:
    """The MoE conversion logits check for a sharded start, on a full CPU copy of a small model.

    The sharded model has no full copy to compare with, so when its ``size`` (bytes) is at most
    ``max_bytes`` this loads the HF model, converts a copy with ``ep = 1`` and compares logits
    (:func:`~streamrl.models.families.check_converted_logits`), then frees both; above it the
    check is skipped with a log line, as holding the full model is what a sharded start avoids.
    Returns the max logit difference, or None when skipped.
    """
    if size > max_bytes:
        log.info("MoE conversion logits check skipped: model of %.2f GB > %.2f GB (sharded start never holds "
                 "the full model)", size / 1e9, max_bytes / 1e9)
        return None
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    probe = probe_ids(full.config.vocab_size)
    ref = reference_logits(full, probe)
    convert_moe_blocks(full)  # in place, ep = 1: the family's conversion is what is checked
    low = dtype != torch.float32
    return check_converted_logits(ref, full, probe, atol=(5e-2 if low else 1e-3) * max(1.0, float(ref.abs().max())))
