"""An engine's weights from a version: a full version is copied, an adapter version merged.

A LoRA run publishes only the adapters (:mod:`streamrl.models.lora`): ``<module>.lora_A.weight``
[r, in], ``<module>.lora_B.weight`` [out, r] and ``lora.scaling``. The engine applies them
**merged**: ``W = W0 + scaling * B @ A`` written into the parameter it already has (in place,
so captured CUDA graphs and compiled decode steps keep reading the same storage), from a copy
``W0`` of the base it holds, taken at the first adapter version. Every version is merged from
``W0``, never from the previous merge, so a version's weights are the same bits whatever came
before (and equal the merged export's, which uses the same :func:`merged_weight`).

Why merged and not unmerged (PEFT layers in the engine): merging costs once per version what
unmerged adapters cost on every forward. Measured on the shared 2-core CPU box with
``streamrl-bench lora --json --repeat 5`` (SmolLM2-135M shapes: 30 layers x q/k/v/o, hidden
576, kv 192, r = 8, float32): merging all 120 projections takes 19 ms per version; unmerged,
the same projections of one batch-16 decode step take 24.7 ms instead of 17.9 ms (two extra
skinny matmuls each, +38 %), so the merge has paid for itself after ~3 decode steps, and a
version lasts many more. The price is the ``W0`` copy of the adapted projections (their bytes
once more, not the whole model).

vLLM keeps its weights in its own packed layout (q/k/v fused into one ``qkv_proj``, prepacked on
CPU), so it cannot be merged into in place; it reloads the merged projections through its
checkpoint-format reload instead. Its ``W0`` comes from the model folder it started from
(:func:`folder_modules`): whole vLLM modules, since vLLM re-processes a module only once all of its
tensors were loaded again.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from streamrl.engines.base import copy_weights_all_or_nothing
from streamrl.models.lora import SCALING_NAME, base_weight_name, group_adapters, is_adapter_version, merged_weight


class EngineWeights:
    """Loads versions into an engine's ``params`` (``{HF name: parameter}``), all or nothing.

    ``base``: ``W0`` of adapted projections in the learner's dtype, for an engine that holds a cast
    copy (:func:`~streamrl.engines.precision.cast_for_engine`); a projection not in it takes its
    ``W0`` from its parameter at the first adapter version. A merge is computed in float32 from
    ``W0`` and rounded once, into the parameter's dtype.
    """

    def __init__(self, params: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None = None):
        self.params = params
        self.master = dict(base or {})  # the adapted projections' W0 in the learner's dtype (cast engines)
        self.base: dict[str, torch.Tensor] = {}  # W0 of each adapted projection (adapter versions)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(named_tensors)
        if not is_adapter_version([n for n, _ in items]):
            copy_weights_all_or_nothing(self.params, items)
            # a full version is the new base; a cast engine keeps its adapted projections unrounded
            named = dict(items)
            self.base, self.master = {}, {n: named[n].detach().clone() for n in self.master}
            return
        named = dict(items)
        scaling = float(named[SCALING_NAME].reshape(-1)[0])
        pairs = group_adapters(named)
        self._check(pairs)
        with torch.no_grad():
            for name in pairs:
                if name not in self.base:
                    master = self.master.get(name)
                    self.base[name] = (self.params[name].detach().clone() if master is None
                                       else master.to(self.params[name].device))
            for name, (a, b) in pairs.items():
                self.params[name].copy_(merged_weight(self.base[name], a, b, scaling))

    def _check(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every adapted projection exists with shape [out, in] = [B.shape[0], A.shape[1]], same r."""
        for name, (a, b) in pairs.items():
            if name not in self.params:
                raise KeyError(f"adapter version: the engine has no parameter {name!r}")
            want = tuple(self.params[name].shape)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != want:
                raise ValueError(f"adapter version: {name} A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                                 f"make the engine's {want}")


def folder_modules(folder: str | Path, adapter_names: Iterable[str], packed: dict[str, list[str]],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{checkpoint name: tensor}`` of the folder's safetensors (cast to ``dtype``, as the engine
    loaded them) for every engine module that an adapter version with ``adapter_names`` adapts.

    A module is the parameter name's prefix with a packed shard renamed to its fused module
    (``packed``: vLLM's ``packed_modules_mapping``, e.g. ``{"qkv_proj": ["q_proj", "k_proj",
    "v_proj"]}``), so ``...q_proj.lora_A.weight`` brings ``q_proj``, ``k_proj`` and ``v_proj``'s
    weights and biases. Raises KeyError when an adapted projection is not in the folder.
    """
    fused = {shard: name for name, shards in packed.items() for shard in shards}

    def module(name: str) -> str:
        prefix, _, leaf = name.rpartition(".")[0].rpartition(".")
        return f"{prefix}.{fused.get(leaf, leaf)}" if prefix else fused.get(leaf, leaf)

    adapted = {base_weight_name(n) for n in adapter_names if n != SCALING_NAME}
    wanted = {module(n) for n in adapted}
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if module(name) in wanted:
                    out[name] = f.get_tensor(name).to(dtype)
    missing = sorted(adapted - set(out))
    if missing:
        raise KeyError(f"adapter version: the model folder {folder} has no tensor {missing[0]!r}")
    return out
