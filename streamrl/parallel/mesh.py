"""The learner's device mesh, defined in exactly one place.

Layout: ``world = dp_shard * ep`` ranks on a 2-D mesh ``("dp_shard", "ep")`` with ``ep`` the
inner (contiguous) dimension, so an expert-parallel group is a run of neighbouring ranks
(one node's NVLink island on GPUs).

* Dense parameters (attention, norms, embeddings, routers) are data-parallel over all
  ``world`` ranks: FSDP2 shards them over a 1-D ``("dp",)`` mesh of every rank.
* Experts are split over ``ep`` (each rank keeps ``E / ep`` of them) and FSDP2 shards each
  rank's experts over ``dp_shard`` (the ranks holding the same experts).
* Every rank trains on its own slice of the batch.

Errors are :class:`ParallelConfigError` (a ``ValueError``) naming the bad value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelConfigError(ValueError):
    """The requested parallel layout does not fit the world size or the model."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the learner's parallel dimensions."""

    world: int
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        """Ranks that hold the same experts (the FSDP dimension of the experts)."""
        return self.world // self.ep

    def validate(self, num_experts: int = 0) -> "ParallelDims":
        if self.world < 1:
            raise ParallelConfigError(f"world size {self.world} must be >= 1")
        if self.ep < 1 or self.world % self.ep:
            raise ParallelConfigError(
                f"learner.ep = {self.ep} must be >= 1 and divide the world size {self.world} "
                f"(world = dp_shard x ep)")
        if self.ep > 1 and num_experts == 0:
            raise ParallelConfigError(f"learner.ep = {self.ep} needs an MoE model; this model has no experts")
        if self.ep > 1 and num_experts % self.ep:
            raise ParallelConfigError(
                f"learner.ep = {self.ep} must divide the number of experts {num_experts}")
        return self

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_shard index, ep index) of ``rank``."""
        return rank // self.ep, rank % self.ep


@dataclass
class LearnerMesh:
    """The meshes and groups the learner uses (``None`` members on a single process)."""

    dims: ParallelDims
    rank: int
    dp_mesh: object | None = None  # 1-D DeviceMesh over all ranks (dense FSDP)
    mesh_2d: object | None = None  # 2-D DeviceMesh ("dp_shard", "ep")
    expert_mesh: object | None = None  # the same ranks as ("ep", "dp_shard"); see build_mesh

    @property
    def ep_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def ep_group(self):
        return self.mesh_2d["ep"].get_group() if self.mesh_2d is not None and self.dims.ep > 1 else None

    @property
    def expert_fsdp_mesh(self):
        """1-D mesh over the ranks holding this rank's experts (size ``dp_shard``)."""
        return self.mesh_2d["dp_shard"] if self.mesh_2d is not None else None

    @property
    def dp_group(self):
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None


def build_mesh(ep: int = 1, device_type: str = "cpu", num_experts: int = 0, single_rank: bool = False) -> LearnerMesh:
    """Validate ``ep`` against the world size (and experts) and build the meshes.

    One process gets no meshes unless ``single_rank``: then 1-rank meshes, so FSDP2 can wrap the
    model for its mixed-precision policy alone (see
    :func:`~streamrl.parallel.expert_parallel.shard_policy`); a process started without a process
    group (not by torchrun) gets a 1-rank one first.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = ParallelDims(world, ep).validate(num_experts)
    if world == 1 and not single_rank:
        return LearnerMesh(dims, rank)
    if not dist.is_initialized():
        # A device mesh needs the default group. In-process store: one rank has no peer to meet.
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    dp = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    m2 = init_device_mesh(device_type, (dims.dp_shard, dims.ep), mesh_dim_names=("dp_shard", "ep"))
    expert = None
    if dims.ep > 1:
        # An expert tensor [E, ...] is split into ep blocks first (rank's ep index), then each
        # block is FSDP-sharded over dp_shard: in DTensor terms (Shard(0), Shard(0)) on a mesh
        # whose OUTER dim is ep. The transpose of m2 is that mesh; checkpoints describe experts
        # with it so DCP stores global tensors and reshards across ep.
        ranks = m2.mesh.t().contiguous()
        expert = DeviceMesh(device_type, ranks, mesh_dim_names=("ep", "dp_shard"))
    return LearnerMesh(dims, rank, dp, m2, expert)
