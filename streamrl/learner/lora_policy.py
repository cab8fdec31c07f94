"""The learner's side of a LoRA run (``model.lora``): what trains, what is published, the reference.

:func:`~streamrl.models.lora.apply_lora` wraps the model with PEFT before sharding, so FSDP2's
``fully_shard`` covers the PEFT-injected layers like any other module (frozen base tensors are
sharded and gathered, only the adapters get gradients and a reduce-scatter). This class then
answers the trainer's LoRA questions in one place:

* the parameters of the optimizer, the gradient clip and the checkpoint: the adapters (and
  the critic's value head, which is trained too), never the frozen base;
* the weights manifest: the adapter tensors under their version names plus ``lora.scaling``;
  bytes proportional to the adapter, not the model;
* the reference policy of ``learner.kl_coef``: the same model under PEFT's
  ``disable_adapter()``, the frozen base, with no second copy in memory.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterator

import torch
from peft import PeftModel
from torch import nn

from streamrl.config import LoraConfig
from streamrl.learner.critic import is_critic_param
from streamrl.models.lora import SCALING_NAME, adapter_parameters, apply_lora, engine_name, lora_scaling
from streamrl.parallel.expert_parallel import full_parameter
from streamrl.parallel.mesh import LearnerMesh

Spec = tuple[str, torch.dtype, tuple[int, ...]]


class LoraPolicy:
    """PEFT LoRA on ``model`` (in place); build before the model is sharded.

    Args:
        model: the HF causal LM (still unsharded, on any device).
        cfg: ``model.lora`` (active).
        seed: the adapters' init seed (``run.seed``).
    """

    def __init__(self, model: nn.Module, cfg: LoraConfig, seed: int):
        self.cfg = cfg
        # PEFT draws lora_A's init from the global generator: seeded, every rank (and every run
        # with this seed) starts from the same adapters before sharding.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.peft: PeftModel = apply_lora(model, cfg)
        self.model = model
        self.scaling = lora_scaling(cfg)

    def freeze_base(self) -> None:
        """Freeze every parameter but the adapters and the value head. Call after
        :func:`~streamrl.parallel.expert_parallel.parallelize`: its expert-parallel MoE blocks
        are new modules with trainable parameters of their own (before the first forward, when
        FSDP2 reads which parameters are trained)."""
        for name, p in self.model.named_parameters():
            p.requires_grad_(engine_name(name) is not None or is_critic_param(name))

    def trainable(self) -> list[nn.Parameter]:
        """The parameters with gradients: the adapters (plus a value head attached after wrapping)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_named(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of :meth:`trainable`, in ``named_parameters`` order (the checkpoint's keys)."""
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def specs(self) -> list[Spec]:
        """The weights manifest of an adapter version: (version name, dtype, global shape) of each
        adapter tensor, then ``lora.scaling`` [1] float32. FSDP2 shards are DTensors whose
        ``shape`` is the global one."""
        out = [(ename, p.dtype, tuple(p.shape)) for _, ename, p in adapter_parameters(self.model)]
        return out + [(SCALING_NAME, torch.float32, (1,))]

    def full_tensors(self, mesh: LearnerMesh) -> Iterator[torch.Tensor]:
        """The full adapter tensors one at a time in :meth:`specs` order (each gather is a
        collective: every rank iterates), then the scaling."""
        for name, _, p in adapter_parameters(self.model):
            yield full_parameter(name, p, mesh)
        yield torch.tensor([self.scaling], dtype=torch.float32)

    def reference(self) -> AbstractContextManager:
        """Context in which the model computes the frozen base's outputs (adapters bypassed)."""
        return self.peft.disable_adapter()
