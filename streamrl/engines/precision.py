"""The rollout engine's own dtype (``rollout.dtype``), apart from the learner's ``model.dtype``.

The learner keeps float32 master weights (bf16 ones drop most small-lr updates) while the
engine may hold and compute in bfloat16, ~14x faster decode steps on an H100 for a
SmolLM2-135M shape. Versions arrive in the learner's dtype and every engine casts them as it
copies them into its own parameters (``Tensor.copy_`` rounds to nearest even, the same bits as
``.to(torch.bfloat16)``). The behaviour log-probs are then those of the bf16 sampler, and the
learner's truncated importance weights correct the mismatch.

An adapter version is merged as ``W0 + scaling * B @ A``: merged from a rounded ``W0`` it would
round twice, so an engine that casts keeps the adapted projections' ``W0`` in the learner's
dtype (:func:`cast_for_engine`) and rounds once, when the merge is written into its parameter.
"""
from __future__ import annotations

import torch
from torch import nn

from streamrl.config import Config
from streamrl.models.lora import lora_targets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_dtype_name(cfg: Config) -> str:
    """The dtype name the engine holds: ``rollout.dtype``, or ``model.dtype`` when that is empty."""
    return cfg.rollout.dtype or cfg.model.dtype


def cast_for_engine(model: nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """Cast ``model`` (the learner's dtype) to the engine's dtype, in place.

    Returns ``{parameter name: W0}``: for a LoRA run whose engine dtype differs from the
    learner's, a copy of each adapted projection's weight ``[out, in]`` in the learner's dtype
    (taken before the cast), which the engine merges adapter versions from; else ``{}``.
    """
    want = DTYPES[engine_dtype_name(cfg)]
    have = next(model.parameters()).dtype
    if want == have:
        return {}
    base = {}
    if cfg.model.lora.active:
        params = dict(model.named_parameters())
        base = {f"{m}.weight": params[f"{m}.weight"].detach().clone() for m in lora_targets(model, cfg.model.lora)}
    model.to(want)
    return base
