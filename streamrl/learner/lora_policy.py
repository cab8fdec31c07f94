"""The learner's side of a LoRA run (``model.lora``): what trains, what is published, the reference.

:func:`~streamrl.models.lora.apply_lora` wraps the model with PEFT before sharding, so FSDP2's
``fully_shard`` covers the PEFT-injected layers like any other module (frozen base tensors are
sharded and gathered, only the adapters get gradients and a reduce-scatter). This class then
answers the trainer's LoRA questions in one place:

* the parameters of the optimizer, the gradient clip and the checkpoint: the adapters (and
  the critic's value head, which is trained too), never the frozen base;
* the weights manifest: the adapter tensors under their version names plus ``lora.scaling``,
  packed into one flat tensor per dtype (:class:`~streamrl.weights.layout.PackedSpec`; one
  float32 tensor with PEFT's float32 adapters), gathered with one collective per pack: bytes
  proportional to the adapter, and a publish that costs about its bytes, not a few hundred
  per-tensor steps (gathers, copies, manifest entries);
* the reference policy of ``learner.kl_coef``: the same model under PEFT's
  ``disable_adapter()``, the frozen base, with no second copy in memory.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterator

import torch
import torch.distributed as dist
from peft import PeftModel
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from streamrl.config import LoraConfig
from streamrl.learner.critic import is_critic_param
from streamrl.models.lora import SCALING_NAME, adapter_parameters, apply_lora, engine_name, lora_scaling
from streamrl.transport.codec import DTYPE_NAMES
from streamrl.weights.layout import PackedSpec

PACK_PREFIX = "lora.adapters."  # + dtype name: the packed tensor of the adapters of that dtype


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
        self._packs: list[tuple[PackedSpec, PackedGather]] | None = None  # see _plan
        self._scaling = torch.tensor([self.scaling], dtype=torch.float32)  # [1], the last piece of the float32 pack

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

    def _plan(self) -> list[tuple[PackedSpec, PackedGather]]:
        """(spec, gather) of each pack, built at the first use (after sharding, when the
        adapters have their final dtype and DTensor placement) and reused by every version."""
        if self._packs is None:
            groups: dict[torch.dtype, list[tuple[str, nn.Module, torch.Tensor]]] = {}
            for name, ename, p in adapter_parameters(self.model):
                module = self.model.get_submodule(name.rpartition(".")[0])
                groups.setdefault(p.dtype, []).append((ename, module, p))
            groups.setdefault(torch.float32, [])  # the scaling's pack
            self._packs = []
            for dt, members in groups.items():
                parts = [(n, tuple(p.shape)) for n, _, p in members]
                parts += [(SCALING_NAME, (1,))] if dt == torch.float32 else []
                spec = PackedSpec(PACK_PREFIX + DTYPE_NAMES[dt], dt, parts)
                self._packs.append((spec, PackedGather([m for _, m, _ in members])))
        return self._packs

    def specs(self) -> list[PackedSpec]:
        """The weights manifest of an adapter version: one packed spec per adapter dtype, named
        ``lora.adapters.<dtype>``, whose parts are (version name, global shape) of each adapter
        tensor of that dtype (FSDP2 shards are DTensors whose ``shape`` is the global one);
        ``lora.scaling`` [1] is the last part of the float32 pack. With PEFT's float32 adapters
        that is one spec."""
        return [spec for spec, _ in self._plan()]

    def full_tensors(self) -> Iterator[list[torch.Tensor]]:
        """The packed tensors of :meth:`specs`, in order, each as its pieces (1-d tensors whose
        concatenation is the pack [N]: the full adapters of one dtype back to back, then the
        scaling), made with one collective (every rank iterates; the adapters are dense, sharded,
        or not, over their own DTensor mesh). The pieces may be the parameters' own memory
        (unsharded: the buffer they are views of): the publisher copies them, read-only
        (``torch.cat(pieces)`` for a pack of your own)."""
        for spec, gather in self._plan():
            yield gather([self._scaling] if spec[1] == torch.float32 else [])

    def reference(self) -> AbstractContextManager:
        """Context in which the model computes the frozen base's outputs (adapters bypassed)."""
        return self.peft.disable_adapter()



class PackedGather:
    """The full adapters of one dtype as the pieces of one packed tensor: a list of 1-d tensors
    whose concatenation is the pack [sum of the adapters' numels] (then a tail), handed to the
    publisher, which concatenates them straight into its store (one op, no pack buffer).

    Plain tensors (no FSDP): at the first call they are moved into one flat buffer, the pack
    itself ([adapters back to back, then the tail]), and each parameter's ``data`` becomes a view
    of it, as a flat-parameter optimizer would; the pieces are then that one buffer, so the
    publisher copies the pack in one op, with no per-adapter work. A parameter whose storage
    was replaced since (``p.data = ...``, ``model.to(...)``) is seen, in O(1) (:meth:`_in_pack`),
    and the buffer is built again. FSDP2 shards (DTensors, ``Shard(0)`` on one 1-d mesh, the
    dense parameters' placement) are gathered in one collective instead of one per tensor: each
    rank concatenates its local rows of every adapter (zero-padded to the longest rank's),
    ``all_gather`` brings every rank's block, and the full adapter ``i`` is rank 0's rows of it,
    then rank 1's, ... (``Shard(0)`` puts the ranks' rows in rank order along dim 0, uneven or
    empty shards included): views of the blocks in that order. Any other placement
    (expert-parallel or multi-dim, which adapters never get: MoE modules are refused as targets)
    is refused rather than guessed.

    Args:
        modules: the ``lora_A`` / ``lora_B`` linears, in pack order. Their ``weight`` is read
            at each call: FSDP2 swaps the registered parameter (sharded / unsharded).
    """

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.numels: list[list[int]] | None = None  # [rank][adapter] local numels, learned once
        # Unsharded adapters (no FSDP: the registered parameters never change) and the flat buffer
        # they live in, with the addresses they had when it was built: a few hundred views and a
        # concatenation of as many pieces per version cost as much as the copy itself.
        self._plain: list[torch.Tensor] | None = None
        self._flat: tuple[list[int], torch.Tensor] | None = None  # (addresses, pack [adapters + tail])
        self._flat_numel = 0  # the adapters' elements in it
        self._tail: torch.Tensor | None = None  # the rest of it: the tail's span
        # The pack's storage (held, so its Python wrapper, and the reference that wrapper holds,
        # stay the same) and how many references it had right after the build: see _in_pack.
        self._storage: torch.UntypedStorage | None = None
        self._refs: int | None = None
        # the one-tensor tail last written into the pack and its version counter then
        self._tail_src: torch.Tensor | None = None
        self._tail_version = -1

    def __call__(self, tail: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pack's pieces (1-d, one dtype), ``tail`` (on the adapters' device) last."""
        if self._plain is not None:  # unsharded: the same parameters every version
            return self._plain_pack(tail)
        params = [m.weight for m in self.modules]
        if not params or not isinstance(params[0], DTensor):
            self._plain = params
            return self._plain_pack(tail)
        with torch.no_grad():
            return self._gather(params, tail)

    def _plain_pack(self, tail: list[torch.Tensor]) -> list[torch.Tensor]:
        """[the pack [adapters + tail]], the parameters' own buffer (built or rebuilt here)."""
        params = self._plain
        if not params:
            return tail
        ntail = sum(t.numel() for t in tail)
        if not self._in_pack(params, ntail):
            self._flatten(params, ntail)
        flat = self._flat[1]
        # A tail written before is not written again (the policy's scaling is the same tensor every
        # version): it is written when it is another tensor, or the same one written in place
        # since (its version counter moved; re-pointing its ``data`` keeps the counter: pass a new
        # tensor). In a publish even a one-element copy_ costs as much as the rest of the pack: its
        # dispatch runs out of the cache.
        if len(tail) == 1 and (tail[0] is not self._tail_src or tail[0]._version != self._tail_version):
            with torch.no_grad():
                self._tail.copy_(tail[0])  # the scaling: a copy_ costs a third of a cat's out= checks
            self._tail_src, self._tail_version = tail[0], tail[0]._version
        elif len(tail) > 1:
            with torch.no_grad():
                torch.cat([t.to(flat.device) for t in tail], out=self._tail)
        return [flat]

    def _gather(self, params: list[DTensor], tail: list[torch.Tensor]) -> list[torch.Tensor]:
        """The FSDP2 shards' pack as pieces: one all_gather (see the class docstring)."""
        tail = [t.to(params[0].device) for t in tail]
        mesh = params[0].device_mesh
        local = [p.to_local().reshape(-1) for p in params]
        if self.numels is None:
            self.numels = self._learn_numels(params, local)
        numels, world, group = self.numels, mesh.size(), mesh.get_group()
        width = max(sum(row) for row in numels)
        send = local[0].new_zeros(width)
        torch.cat(local, out=send[: sum(numels[mesh.get_local_rank()])])
        blocks = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(blocks, send, group=group)
        starts = [0] * world  # where the next adapter's rows begin in each rank's block
        pieces = []
        for i in range(len(params)):
            for r in range(world):
                pieces.append(blocks[r][starts[r]: starts[r] + numels[r][i]])
                starts[r] += numels[r][i]
        return pieces + tail

    @torch.no_grad()
    def _flatten(self, params: list[torch.Tensor], ntail: int) -> torch.Tensor:
        """Move ``params`` (one device and dtype) into a new flat buffer [their numels + ``ntail``],
        each parameter's ``data`` a view of its span (values, requires_grad, gradients and the
        optimizer's state of the parameter object unchanged); returns the buffer."""
        if len({p.device for p in params}) > 1:
            raise ValueError(f"LoRA adapters of one dtype on several devices {sorted({str(p.device) for p in params})}: "
                             f"expected one (the model's)")
        n = sum(p.numel() for p in params)
        flat = torch.empty(n + ntail, dtype=params[0].dtype, device=params[0].device)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[:n])
        start = 0
        for p in params:
            p.data = flat[start: start + p.numel()].view(p.shape)
            start += p.numel()
        self._flat, self._flat_numel, self._tail = ([p.data_ptr() for p in params], flat), n, flat[n:]
        self._storage = flat.untyped_storage()
        self._refs = _storage_refs(self._storage)
        self._tail_src = None  # the tail's span is new
        return flat

    def _in_pack(self, params: list[torch.Tensor], ntail: int) -> bool:
        """Whether every parameter still lives where :meth:`_flatten` put it (and the tail fits).

        O(1) in the common case. A parameter's storage changes only by re-pointing its tensor
        (``p.data = ...``, ``p.set_(...)``, ``swap_tensors``: what ``model.to(...)`` does); the
        optimizer, the gradient clip, checkpoint saves (clones) and loads (in place) write through
        the views. Each view holds one reference to the pack's storage, so re-pointing a parameter
        drops one: when the storage has exactly the references it had after the build (the
        parameters', the buffer's, the tail's, the held wrapper's), no parameter left it, and
        reading every parameter's address (a few hundred tensors touched per version, out of the
        cache when something else ran since: a tenth of an adapter version's publish) is skipped.
        Any other count (a parameter re-pointed, or views of the parameters alive elsewhere: an
        autograd graph, a caller's ``p.detach()``) compares the addresses. What the count cannot
        see: parameters re-pointed while as many views of the old pack stay alive elsewhere
        (``old = p.data; p.data = new``, ``old`` kept past the publish), or re-pointed into the
        pack's own storage at another offset (``p.set_(...)``); nothing in the learner does either.
        """
        if self._flat is None or self._flat[1].numel() != self._flat_numel + ntail:
            return False
        refs = _storage_refs(self._storage)
        if refs is not None and refs == self._refs:
            return True
        return self._flat[0] == list(map(torch.Tensor.data_ptr, params))

    @staticmethod
    def _learn_numels(params: list[DTensor], local: list[torch.Tensor]) -> list[list[int]]:
        """Check the placement and gather every rank's local numel of each adapter (a collective:
        the ranks' shapes differ when a dim 0 does not divide by the world)."""
        mesh = params[0].device_mesh
        if mesh.ndim != 1 or not all(isinstance(p, DTensor) and p.device_mesh == mesh
                                     and tuple(p.placements) == (Shard(0),) for p in params):
            raise ValueError("LoRA adapters: expected every adapter as a DTensor with Shard(0) on one 1-d mesh "
                             "(FSDP2's dense placement)")
        mine = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=local[0].device)
        sizes = [torch.empty_like(mine) for _ in range(mesh.size())]
        dist.all_gather(sizes, mine, group=mesh.get_group())
        return torch.stack(sizes).tolist()


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # a torch internal: absent, every check compares addresses


def _storage_refs(storage: torch.UntypedStorage) -> int | None:
    """How many references ``storage`` (its StorageImpl) has: one per tensor viewing it, one per
    Python wrapper; None where this torch has no such counter."""
    return _USE_COUNT(storage._cdata) if _USE_COUNT is not None else None
