"""LoRA models out of a run: from a checkpoint (adapters + optimizer only) or the live learner.

A LoRA checkpoint holds the trained parameters alone, under the learner's names
(``model.<...>.q_proj.lora_A.default.weight``): the base is rebuilt from ``model.path`` (or
the seeded tiny model) and PEFT-wrapped the same way, then DCP reads the adapters into it.
From there:

* :func:`merged_model`: the plain HF model with the adapters merged by
  :func:`~streamrl.models.lora.merged_weight`, the engines' merge, so the exported folder's
  weights are the ones the rollout engines generated with, bit for bit;
* :func:`save_adapter_folder`: PEFT's own adapter folder (``adapter_config.json`` +
  ``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, folder)`` loads.
"""
from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from torch import nn

from streamrl.engines.adapter_merge import EngineWeights
from streamrl.models.lora import SCALING_NAME, adapter_parameters, apply_lora, lora_scaling


def plain_name(name: str) -> str:
    """The plain HF model's name of a PEFT-wrapped base parameter (``q_proj.base_layer.weight``
    -> ``q_proj.weight``); other names are unchanged."""
    return name.replace(".base_layer.", ".")


def load_lora_checkpoint(ckpt: Path, cfg) -> tuple[PeftModel, object]:
    """``(peft_model, tokenizer)``: the run's base with the checkpoint's adapters, in this process.

    Raises :class:`~streamrl.learner.run_checkpoint.CheckpointError` when the checkpoint's
    adapter tensors are not the ones ``cfg.model.lora`` makes.
    """
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 (heavy, only for exports)

    from streamrl.learner.run_checkpoint import CheckpointError  # noqa: PLC0415 (the learner, heavy)
    from streamrl.models.factory import load_model_and_tokenizer  # noqa: PLC0415

    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    peft_model = apply_lora(model, cfg.model.lora)
    targets = {f"model.{n}": p.data for n, _, p in adapter_parameters(model)}
    reader = dcp.FileSystemReader(str(ckpt))
    saved = {k for k in reader.read_metadata().state_dict_metadata
             if k.startswith("model.") and ".lora_" in k}
    if saved != set(targets):
        missing, unexpected = sorted(set(targets) - saved), sorted(saved - set(targets))
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not hold the adapters of model.lora: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    dcp.load(targets, storage_reader=reader, no_dist=True)
    return peft_model, tok


def adapter_version(model: nn.Module, scaling: float) -> list[tuple[str, torch.Tensor]]:
    """The adapter version (engine names) of ``model``'s current adapters."""
    items = [(ename, p.detach()) for _, ename, p in adapter_parameters(model)]
    return items + [(SCALING_NAME, torch.tensor([scaling], dtype=torch.float32))]


def merged_model(peft_model: PeftModel, cfg) -> nn.Module:
    """The plain HF model, base + adapters merged (PEFT's layers removed). Consumes ``peft_model``."""
    version = adapter_version(peft_model.base_model.model, lora_scaling(cfg.model.lora))
    version = [(n, t.clone()) for n, t in version]  # unload() drops the adapter modules
    model = peft_model.unload()
    EngineWeights(dict(model.named_parameters())).load(version)
    return model


def save_adapter_folder(peft_model: PeftModel, out: Path) -> Path:
    """Write the PEFT adapter folder ``out`` (``PeftModel.from_pretrained(base, out)`` loads it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out
