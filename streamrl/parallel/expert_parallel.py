"""Apply expert parallelism and FSDP2 to a transformers causal LM, and gather it back.

:func:`parallelize` (torchtitan's order: experts first, then blocks, then the root):

1. swap every sparse-MoE block for an :class:`~streamrl.models.moe.EPMoEBlock` holding this
   rank's ``E / ep`` experts;
2. ``fully_shard`` each rank's experts over the ``dp_shard`` ranks that hold the same experts
   (when ``ep > 1``), with the 1/ep gradient scale that makes the all-to-all gradient sum a
   per-rank average;
3. ``fully_shard`` every decoder layer, then the whole model, over all ranks (dense params);
   bf16 parameters with fp32 gradient reduction on GPU when mixed precision is on, which is
   also the one reason to wrap a single process (:func:`shard_policy`).

:func:`full_parameter` gathers one full, global tensor (FSDP all-gather, then an all-gather of
expert slices over ``ep``) for weight publishing.

A model built by :func:`~streamrl.models.sharded_load.build_empty_model` (parameters on the
meta device) goes through the same steps on meta, then each rank materialises and reads only
its own shards from the HF folder (:func:`~streamrl.models.sharded_load.materialize_and_load`).
"""
from __future__ import annotations

import functools
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from streamrl.models.families import check_converted_logits, moe_family, probe_ids, reference_logits
from streamrl.models.moe import EPMoEBlock, convert_moe_blocks, is_expert_param
from streamrl.models.sharded_load import (WEIGHTS_FOLDER_ATTR, check_conversion_on_copy, has_meta_params,
                                          materialize_and_load, model_bytes)
from streamrl.parallel.mesh import LearnerMesh


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (FSDP units)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"model {type(model).__name__} has no .model.layers; cannot shard it per layer")
    return list(layers)


# The dims that grow with the packed row length N, per decoder-layer input (transformers' names):
# hidden_states [B, N, H], position_ids [B, N], cache_position [N], position_embeddings
# (cos, sin) [B, N, D] each, a dense attention_mask [B, 1, N, N].
_SEQ_DIMS = {"hidden_states": (1,), "position_ids": (1,), "cache_position": (0,),
             "position_embeddings": (1,), "attention_mask": (2, 3)}


def _mark_seq_dynamic(name: str, value) -> None:
    """Hint dynamo that ``value``'s row-length dims vary (no error if a graph specialises them)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            _mark_seq_dynamic(name, v)
    elif isinstance(value, torch.Tensor):
        for d in _SEQ_DIMS.get(name, ()):
            if d < value.dim():
                torch._dynamo.maybe_mark_dynamic(value, d)


def _seq_dynamic(compiled_forward):
    """Wrap a compiled decoder-layer forward so its first graph is already symbolic in N.

    Packed micro-batches have a new length N almost every step. Left alone, dynamo compiles a
    static graph for the first N, recompiles once more for the second and only then turns N
    symbolic; marking N dynamic up front makes that one compile per layer variant.
    """

    @functools.wraps(compiled_forward)
    def forward(hidden_states, *args, **kwargs):
        _mark_seq_dynamic("hidden_states", hidden_states)
        for name, value in kwargs.items():
            _mark_seq_dynamic(name, value)
        return compiled_forward(hidden_states, *args, **kwargs)

    return forward


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile`` the forward of every decoder layer, in place; returns how many.

    The layer's ``forward`` is replaced, not the module: parameter names stay those of
    transformers (no ``_orig_mod.``), and FSDP2's pre/post-forward hooks, which run in
    ``Module.__call__``, stay outside the compiled region (they all-gather and free shards).
    The packed row length is marked dynamic (:func:`_seq_dynamic`), so micro-batches of new
    lengths reuse the graphs instead of recompiling. Layers with a data-dependent split (EP
    all-to-all sizes, the CPU expert loop) compile in pieces around the graph breaks. On one
    H200 this took the learner-step benchmark's 1.31 B MoE from 119.6k to 164.4k tokens/s
    (``streamrl.bench.learner_step --compile``).
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = _seq_dynamic(torch.compile(layer.forward, dynamic=None))
    # The final norm runs between the last layer and the LM head, outside the layers' graphs:
    # eager, its fp32 upcast is ~10 passes over [1, N, H] (forward and backward); compiled, two.
    norm = getattr(getattr(model, "model", model), "norm", None)
    if isinstance(norm, nn.Module):
        norm.forward = _seq_dynamic(torch.compile(norm.forward, dynamic=None))
    return len(layers)


# Above this size (bytes of the whole model) a sharded start skips the MoE conversion logits
# check: it needs one full copy of the model on each rank, which is what a sharded start avoids.
CHECK_LOGITS_MAX_BYTES = 1 << 30


def parallelize(model: nn.Module, mesh: LearnerMesh, device: torch.device, experts_impl: str = "auto",
                mixed_precision: bool = True, compile_layers: bool = False, check_logits: bool = True
                ) -> list[EPMoEBlock]:
    """Convert MoE blocks to expert parallel and shard with FSDP2 (in place). Returns the blocks.

    ``compile_layers``: ``torch.compile`` each decoder layer (see :func:`compile_decoder_layers`).
    ``check_logits``: for an MoE, compare the parallel model's logits on a few probe tokens with
    the HF model's before conversion and raise a one-line ConfigError when they differ
    (:func:`~streamrl.models.families.check_converted_logits`); a collective with ``ep > 1``.
    A model with meta parameters (a sharded start) is sharded on meta, then each rank loads
    its shards; its logits check runs on a full CPU copy, only up to ``CHECK_LOGITS_MAX_BYTES``.
    """
    impl = experts_impl
    if impl == "auto":
        impl = "grouped_mm" if device.type == "cuda" else "loop"
    ep = mesh.dims.ep
    if has_meta_params(model):
        folder = getattr(model, WEIGHTS_FOLDER_ATTR)
        if check_logits and moe_family(model.config) is not None:  # unsupported families raise here
            check_conversion_on_copy(folder, next(model.parameters()).dtype, CHECK_LOGITS_MAX_BYTES,
                                     model_bytes(model))
        blocks = convert_moe_blocks(model, mesh.ep_rank, ep, mesh.ep_group, impl)
        _shard(model, blocks, mesh, device, mixed_precision, compile_layers)
        n_local = blocks[0].n_local if blocks else 0
        materialize_and_load(model, folder, device, mesh.ep_rank, n_local)
        return blocks
    probe = ref = None
    if check_logits and moe_family(model.config) is not None:  # unsupported families raise here
        probe = probe_ids(model.config.vocab_size)
        ref = reference_logits(model, probe)
    blocks = convert_moe_blocks(model, mesh.ep_rank, ep, mesh.ep_group, impl)
    if ref is not None:
        # Before sharding, where the model is still the plain module: a no-grad forward through
        # an FSDP2 root before the first training step left the 2-rank learner training nothing
        # (entropy flat for 700 steps). With ep > 1 the forward's all-to-all is still collective.
        low = next(model.parameters()).dtype != torch.float32
        check_converted_logits(ref, model, probe, atol=(5e-2 if low else 1e-3) * max(1.0, float(ref.abs().max())))
    _shard(model, blocks, mesh, device, mixed_precision, compile_layers)
    return blocks


def shard_policy(world: int, device_type: str, mixed_precision: bool) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy the learner's model is wrapped with, or None: not wrapped at all.

    On CUDA with ``learner.mixed_precision``: bf16 compute copies of the parameters, fp32
    gradient reduction, master weights and optimizer state in the model's dtype, at every world
    size; one process is wrapped too (a 1-rank mesh; its all-gather is the bf16 cast and its
    reduce-scatter the fp32 cast back), since an fp32 model otherwise trains in pure fp32 (an
    SmolLM2-135M step took 1.224 s against 0.147 s in bf16 on an H100). Elsewhere several ranks
    are wrapped without casts and one process is left as it is (CPU runs keep fp32 numerics).
    """
    if device_type == "cuda" and mixed_precision:
        # param_dtype: a no-op cast for a bf16 model, the bf16 compute copy of an fp32 one.
        # reduce_dtype stays fp32 although it costs a bf16 -> fp32 -> bf16 round trip of every
        # gradient: a reduce-scatter summing W bf16 shards rounds W - 1 times (the per-rank
        # average drifts ~W/256 relative); in fp32 the sum rounds once, on the way back.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy() if world > 1 else None


def _shard(model: nn.Module, blocks: list[EPMoEBlock], mesh: LearnerMesh, device: torch.device,
           mixed_precision: bool, compile_layers: bool) -> None:
    if not has_meta_params(model):  # meta parameters get their device in materialize_and_load
        model.to(device)
    if compile_layers:
        compile_decoder_layers(model)
    mp = shard_policy(mesh.dims.world, device.type, mixed_precision)
    # One process is wrapped only on a mesh built for it (build_mesh(single_rank=True), as the
    # trainer does); tools that build a plain one-process mesh keep their unwrapped model.
    if mp is not None and mesh.dp_mesh is not None:
        shard_model(model, blocks, mesh, mp)


def shard_model(model: nn.Module, blocks: list[EPMoEBlock], mesh: LearnerMesh, mp: MixedPrecisionPolicy) -> None:
    """``fully_shard`` the experts (``ep > 1``), every decoder layer, then the root, with ``mp``.

    ``mesh`` must have its meshes (:func:`~streamrl.parallel.mesh.build_mesh`, with
    ``single_rank`` for one process).
    """
    if mesh.dp_mesh is None:
        raise ValueError("shard_model: the learner mesh has no device mesh (one process: build_mesh(single_rank=True))")
    ep = mesh.dims.ep
    if ep > 1:
        for b in blocks:
            b.experts.grad_scale = 1.0 / ep
            fully_shard(b.experts, mesh=mesh.expert_fsdp_mesh, mp_policy=mp)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh.dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh.dp_mesh, mp_policy=mp)


def global_param_specs(model: nn.Module, ep: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, global shape) of every parameter, in ``named_parameters`` order."""
    specs = []
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if is_expert_param(name):
            shape[0] *= ep
        specs.append((name, p.dtype, tuple(shape)))
    return specs


def full_parameter(name: str, p: torch.Tensor, mesh: LearnerMesh) -> torch.Tensor:
    """The full global tensor of one parameter (a collective on every rank), detached.

    On a one-rank mesh (FSDP2 wrapping one GPU for its mixed-precision policy alone) the local
    shard is the whole tensor, whatever the placement: it is returned itself, read-only by
    contract. A redistribute would copy every tensor of every published version, and its Python
    per parameter is several times the publisher's own; ``p.data`` (a new DTensor per call) is
    avoided for the same reason.
    """
    with torch.no_grad():
        if isinstance(p, DTensor):
            t = p.to_local() if p.device_mesh.size() == 1 else p.full_tensor()
        else:
            t = p
        if mesh.dims.ep > 1 and is_expert_param(name):
            parts = [torch.empty_like(t) for _ in range(mesh.dims.ep)]
            dist.all_gather(parts, t.contiguous(), group=mesh.ep_group)
            t = torch.cat(parts, 0)
    return t.detach()


def global_expert_view(t: torch.Tensor, mesh: LearnerMesh) -> torch.Tensor:
    """An ep-sharded expert tensor as a DTensor of its global shape ``[E, ...]`` (no copy).

    ``t`` is a routed-expert parameter or its optimizer state on this rank: ``[E / ep, ...]``,
    FSDP-sharded over ``dp_shard`` (a DTensor) when the world has more ranks than ``ep``.
    The result shares ``t``'s local storage and tells DCP where this shard sits in the global
    tensor, so checkpoints hold every expert once, as one global tensor, and load back under
    any ``ep`` or world size (or in one process). With ``ep = 1`` ``t`` is already global.
    """
    ep = mesh.dims.ep
    if ep == 1:
        return t
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = (t.shape[0] * ep, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh.expert_mesh, [Shard(0), Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=stride)

