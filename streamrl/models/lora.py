"""LoRA on the learner's model through PEFT: validation, wrapping, adapter names, the merge.

The learner wraps its Hugging Face model with :func:`peft.get_peft_model`; PEFT freezes the
base and injects ``lora_A`` / ``lora_B`` into the targeted ``nn.Linear`` modules *in place*,
so the HF module the trainer shards, checkpoints per layer and calls is the same object, with
parameter names ``...q_proj.base_layer.weight`` (frozen) and ``...q_proj.lora_A.default.weight``
[r, in] / ``...q_proj.lora_B.default.weight`` [out, r] (trainable, float32 on a bf16 base:
PEFT's ``autocast_adapter_dtype``).

A weights version of a LoRA run carries only the adapters, under engine names
``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (the PEFT adapter file's names without
``base_model.model.``), plus ``lora.scaling`` ([1] float32, ``alpha / r``); the learner publishes
them packed into one flat tensor per dtype (:mod:`streamrl.learner.lora_policy`), which the
subscriber hands to engines as these per-tensor views again. Engines merge them
into the base they hold with :func:`merged_weight`; the merged export uses the same function,
so an engine's weights and the exported folder are bit-identical.

Refused (one-line :class:`~streamrl.errors.ConfigError` at load and at ``--dry-run``): a
``target_modules`` entry that matches no ``nn.Linear``, a match inside an MoE block (routed
experts are fused 3-d parameters, the router drives the expert-parallel all-to-all), the LM
head of a model that ties it to the input embeddings, and families whose projections are not
``nn.Linear`` [out, in] (``gpt2``'s ``Conv1D``). An untied ``lm_head`` may be adapted: the
learner's chunked log-probs read its weight through :func:`head_weight`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import AutoModelForCausalLM

from streamrl.config import LoraConfig, ModelConfig
from streamrl.errors import ConfigError
from streamrl.models.factory import tiny_moe_config
from streamrl.models.sharded_load import build_empty_model, params_on_meta
from streamrl.models.tokenizer import build_char_tokenizer

ADAPTER_NAME = "default"
SCALING_NAME = "lora.scaling"
_SUFFIXES = ("lora_A", "lora_B")
# Families whose attention/MLP projections are not nn.Linear [out, in] (the merge's layout).
REFUSED_FAMILIES = {"gpt2": "Conv1D projections (fan_in_fan_out)", "gpt_bigcode": "fused c_attn projection",
                    "falcon": "fused query_key_value projection"}
# Module-name pieces of MoE blocks: their experts and router are not adapted.
_MOE_PARTS = (".experts", ".mlp.gate", ".shared_expert_gate", ".block_sparse_moe.gate", ".router")


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of names: the module name is the target or ends with ``.target``."""
    return name == target or name.endswith("." + target)


def lora_targets(model: nn.Module, cfg: LoraConfig, field: str = "model.lora.target_modules") -> list[str]:
    """Names of the modules ``cfg.target_modules`` adapts in ``model``; raises ConfigError for a
    refused family, an entry that matches no ``nn.Linear``, or a match inside an MoE block."""
    family = str(getattr(getattr(model, "config", None), "model_type", "?"))
    if family in REFUSED_FAMILIES:
        raise ConfigError(f"config field 'model.lora' on model family {family!r}: refused "
                          f"({REFUSED_FAMILIES[family]}; adapter merging needs nn.Linear [out, in])")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = []
    for target in cfg.target_modules:
        hits = [n for n in names if _matches(n, target)]
        if not hits:
            raise ConfigError(f"config field '{field}' = {cfg.target_modules!r}: {target!r} matches no "
                              f"nn.Linear of the {family} model")
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if tied and any(m is model.get_output_embeddings() for n, m in model.named_modules() if n in hits):
            raise ConfigError(f"config field '{field}' = {cfg.target_modules!r}: {target!r} is the LM head, whose "
                              f"weight this model ties to the input embeddings (an adapter would move both)")
        moe = [n for n in hits if any(part in n for part in _MOE_PARTS)]
        if moe:
            raise ConfigError(f"config field '{field}' = {cfg.target_modules!r}: {target!r} matches MoE "
                              f"expert/router module {moe[0]!r}; LoRA adapts attention and dense MLP linears only")
        found += hits
    return sorted(set(found))


def apply_lora(model: nn.Module, cfg: LoraConfig) -> PeftModel:
    """Wrap ``model`` with PEFT LoRA (in place: ``model`` now holds the adapters); returns the
    PeftModel, whose ``disable_adapter()`` context runs the frozen base (the reference policy)."""
    targets = lora_targets(model, cfg)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none", init_lora_weights=True)
    return get_peft_model(model, peft_cfg, adapter_name=ADAPTER_NAME)


def head_weight(head: nn.Module) -> torch.Tensor:
    """The LM head's weight [V, H] as its forward would apply it: ``W0 + scaling * B @ A`` while
    a LoRA adapter is active (differentiable in A and B), else the plain weight.

    For code that reads the head's weight instead of calling it (the learner's chunked
    log-probs). Adapter dropout does not apply here (``model.lora.dropout`` is for the others).
    """
    if not isinstance(head, LoraLayer) or head.disable_adapters or head.merged:
        return head.weight
    w = head.base_layer.weight
    for name in head.active_adapters:
        if name in head.lora_A:
            delta = head.lora_B[name].weight @ head.lora_A[name].weight * head.scaling[name]
            w = w + delta.to(w.dtype)
    return w


def lora_scaling(cfg: LoraConfig) -> float:
    """PEFT's LoRA scale ``alpha / r``."""
    return float(cfg.alpha) / float(cfg.r)


def engine_name(param_name: str) -> str | None:
    """The version name of a trainable adapter parameter (None for any other parameter):
    ``m.q_proj.lora_A.default.weight`` -> ``m.q_proj.lora_A.weight``."""
    for s in _SUFFIXES:
        piece = f".{s}.{ADAPTER_NAME}.weight"
        if param_name.endswith(piece):
            return param_name[: -len(piece)] + f".{s}.weight"
    return None


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(learner name, version name, parameter) of every adapter tensor, in ``named_parameters`` order."""
    for name, p in model.named_parameters():
        ename = engine_name(name)
        if ename is not None:
            yield name, ename, p


def is_adapter_version(names: list[str]) -> bool:
    """A version's tensor names are an adapter version (it carries ``lora.scaling``)."""
    return SCALING_NAME in names


def base_weight_name(adapter_name: str) -> str:
    """``m.q_proj.lora_A.weight`` -> ``m.q_proj.weight`` (the plain HF model's parameter)."""
    module = adapter_name.rsplit(".", 2)[0]
    return f"{module}.weight"


@torch.no_grad()
def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * B @ A`` in ``base``'s dtype and device.

    Args: base [out, in]; lora_a [r, in]; lora_b [out, r] (any float dtype: computed in float32).
    The one merge of the project (engines and the merged export), so both give the same bits.
    """
    dev = base.device
    merged = torch.addmm(base.to(torch.float32), lora_b.to(dev, torch.float32), lora_a.to(dev, torch.float32),
                         alpha=scaling)  # one fused kernel: no [out, in] temporary for the delta
    return merged.to(base.dtype)


def group_adapters(named: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base weight name: (A, B)}`` from a version's ``{name: tensor}`` (``lora.scaling`` left
    out); raises ValueError when a module has only one of its two factors."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        if name == SCALING_NAME:
            continue
        kind = name.rsplit(".", 2)[-2]
        if kind not in _SUFFIXES:
            raise ValueError(f"adapter version: tensor {name!r} is neither lora_A nor lora_B")
        pairs.setdefault(base_weight_name(name), {})[kind] = t
    incomplete = [n for n, d in pairs.items() if len(d) != 2]
    if incomplete:
        raise ValueError(f"adapter version: {incomplete[0]} has only {sorted(pairs[incomplete[0]])}")
    return {n: (d["lora_A"], d["lora_B"]) for n, d in pairs.items()}


def lora_problems(model_cfg: ModelConfig, folder: Path | None) -> list[str]:
    """One line per problem of ``model.lora`` against the model it adapts (none when LoRA is off):
    the model is built on the meta device from ``folder``'s config.json (or the tiny model's
    config), so nothing is read but the config."""
    if not model_cfg.lora.active:
        return []
    if folder is None:
        tok = build_char_tokenizer()
        hf_cfg = tiny_moe_config(model_cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(hf_cfg)
    else:
        model = build_empty_model(folder, torch.float32)
    try:
        lora_targets(model, model_cfg.lora)
    except ConfigError as e:
        return [str(e)]
    return []
