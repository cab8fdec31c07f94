"""Names and layouts of the learner's parameters -> the rollout engine's, in one place.

The learner trains a transformers 5.x model; engines want their own names and layouts:

* ``hf``: identity (the HF engine, or any transformers model).
* ``vllm``: vLLM's checkpoint names. Dense names are HF's. Qwen3-MoE / Qwen2-MoE experts,
  which transformers 5 stores fused as ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I], are split into per-expert
  ``mlp.experts.{e}.gate_proj.weight`` [I, H], ``.up_proj.weight`` [I, H] and
  ``.down_proj.weight`` [H, I] (the layout every vLLM MoE ``load_weights`` accepts;
  vLLM packs q/k/v and gate/up itself while loading, so they stay unpacked here).

Splitting produces *views* of the fused tensor (``gate_up[e, :I]`` is contiguous), so the
adapter adds no memory. :func:`unadapt` is the inverse, used by tests and by engines that
want HF names back.

The router EMA the learner publishes (``learner.router_ema``) lives in the trainer
(:mod:`streamrl.learner.moe_router`); the publisher ships whatever the trainer gathers.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

TARGETS = ("hf", "vllm")
_FUSED = re.compile(r"^(?P<p>.*\.mlp\.experts)\.(?P<w>gate_up_proj|down_proj)$")
_SPLIT = re.compile(r"^(?P<p>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"weights naming target {target!r} is unknown; choose one of {TARGETS}")


def adapt_spec(spec: Spec, target: str) -> list[Spec]:
    """Engine specs produced by one learner spec (1 -> 1, or 1 -> E or 2E for fused experts)."""
    _check_target(target)
    name, dtype, shape = spec
    m = _FUSED.match(name)
    if target == "hf" or m is None:
        return [spec]
    p, w = m["p"], m["w"]
    if len(shape) != 3:
        raise ValueError(f"fused expert weight {name} has shape {shape}; expected [E, N, K]")
    e_count, n, k = shape
    if w == "gate_up_proj":
        if n % 2:
            raise ValueError(f"{name}: gate_up_proj dim 1 = {n} is not even")
        out = []
        for e in range(e_count):
            out.append((f"{p}.{e}.gate_proj.weight", dtype, (n // 2, k)))
            out.append((f"{p}.{e}.up_proj.weight", dtype, (n // 2, k)))
        return out
    return [(f"{p}.{e}.down_proj.weight", dtype, (n, k)) for e in range(e_count)]


def adapt_specs(specs: list[Spec], target: str) -> list[Spec]:
    """Engine-side specs for the learner's ``specs``, in publish order."""
    return [s for spec in specs for s in adapt_spec(spec, target)]


def adapt_tensor(name: str, tensor: torch.Tensor, target: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(engine name, view) pairs for one full learner tensor, in :func:`adapt_spec` order."""
    _check_target(target)
    m = None if target == "hf" else _FUSED.match(name)  # hf: no regex per tensor (adapter versions have hundreds)
    if m is None:
        yield name, tensor
        return
    p, w = m["p"], m["w"]
    if w == "gate_up_proj":
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{p}.{e}.gate_proj.weight", tensor[e, :half]
            yield f"{p}.{e}.up_proj.weight", tensor[e, half:]
    else:
        for e in range(tensor.shape[0]):
            yield f"{p}.{e}.down_proj.weight", tensor[e]


def unadapt(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of the ``vllm`` adaptation: fuse per-expert weights back to HF layout.

    Returns ``{hf_name: tensor}``; fused tensors are new [E, 2I, H] / [E, H, I] tensors.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in named:
        m = _SPLIT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault((m["p"], m["w"]), {})[int(m["e"])] = t
    prefixes = {p for p, _ in experts}
    for p in prefixes:
        gates, ups, downs = (experts.get((p, w), {}) for w in ("gate_proj", "up_proj", "down_proj"))
        n = len(downs)
        if sorted(gates) != list(range(n)) or sorted(ups) != list(range(n)) or sorted(downs) != list(range(n)):
            raise ValueError(f"{p}: per-expert weights are incomplete (gate {len(gates)}, up {len(ups)}, down {n})")
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([gates[e], ups[e]], 0) for e in range(n)])
        out[f"{p}.down_proj"] = torch.stack([downs[e] for e in range(n)])
    return out
