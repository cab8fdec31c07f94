"""Test helper: full tensors from sharded parameters, one at a time (the publish test's learner).

FSDP2 parameters are DTensors (``Shard(0)`` over the ``dp`` mesh dim); expert-parallel
experts are either DTensors sharded over an ``ep`` mesh dim too (any placements:
``full_tensor()`` all-gathers over every sharded mesh dim) or plain local tensors holding
``E / ep`` experts, described by an :class:`ExpertShard` and gathered with an explicit
``all_gather`` over the expert-parallel group.

Every rank must run the same iteration (each gather is a collective); only the consumer on
the publishing rank keeps the result, and only until the next tensor is produced, so the
extra memory at any time is one full tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertShard:
    """A plain tensor that is one rank's slice of a parameter along ``dim`` over ``group``.

    All ranks of ``group`` hold equally sized slices, in rank order.
    """

    group: dist.ProcessGroup | None
    dim: int = 0


def full_tensor(t: torch.Tensor, shard: ExpertShard | None = None) -> torch.Tensor:
    """The full (unsharded) value of ``t``: DTensor -> ``full_tensor()``; an expert shard ->
    ``all_gather`` + ``cat`` along its dim; anything else is returned as is."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    if shard is None:
        return t
    world = dist.get_world_size(shard.group)
    if world == 1:
        return t
    local = t.contiguous()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=shard.group)
    return torch.cat(parts, dim=shard.dim)


def full_parameters(model: torch.nn.Module, expert_shards: dict[str, ExpertShard] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter of ``model`` in ``named_parameters`` order.

    ``expert_shards``: parameters that are plain local slices (explicit expert parallel).
    """
    shards = expert_shards or {}
    for name, p in model.named_parameters():
        with torch.no_grad():
            yield name, full_tensor(p.data if not hasattr(p, "full_tensor") else p, shards.get(name)).detach()


def global_specs(model: torch.nn.Module, expert_shards: dict[str, ExpertShard] | None = None
                 ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, global shape)`` of every parameter, without gathering anything."""
    shards = expert_shards or {}
    out = []
    for name, p in model.named_parameters():
        shape = list(p.shape)  # a DTensor reports its global shape
        s = shards.get(name)
        if s is not None and not hasattr(p, "full_tensor"):
            shape[s.dim] *= dist.get_world_size(s.group)
        out.append((name, p.dtype, tuple(shape)))
    return out
