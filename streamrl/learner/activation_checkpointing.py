"""Activation checkpointing per decoder layer (``learner.activation_checkpointing``).

Why: at long sequence lengths the activations saved for backward, not the weights, fill the
accelerator (per layer: attention inputs, MLP/expert intermediates for every token). With
checkpointing a layer keeps only its input; the backward recomputes the layer's forward.

How, and why this way: like :func:`streamrl.parallel.expert_parallel.compile_decoder_layers`,
the layer's ``forward`` is replaced on the instance, not the module wrapped, so parameter
names stay those of transformers and FSDP2's hooks (in ``Module.__call__``) stay outside: the
recompute runs while FSDP2 has the layer's parameters gathered for its backward. Non-reentrant
``torch.utils.checkpoint`` is used (kwargs, no ``requires_grad`` inputs needed). A compiled
layer is checkpointed as compiled.

The MoE blocks read ``replay`` (R3 expert ids) from an attribute the trainer sets around the
forward and clears after it; the recompute in backward happens later, so each checkpointed
call captures the replay ids of its forward and restores them for its recompute. Expert
all-to-alls run again in the recompute, in the same order on every rank (the backward order).
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from streamrl.models.moe import EPMoEBlock
from streamrl.parallel.expert_parallel import decoder_layers


def checkpoint_decoder_layers(model: nn.Module) -> int:
    """Checkpoint the forward of every decoder layer of ``model``, in place; returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        moe = [m for m in layer.modules() if isinstance(m, EPMoEBlock)]
        layer.forward = _checkpointed(layer.forward, moe)
    return len(layers)


def _checkpointed(forward, moe: list[EPMoEBlock]):
    def run_checkpointed(*args, **kwargs):
        replays = [m.replay for m in moe]  # the ids of THIS forward, also for its recompute

        def body(*a, **k):
            outer = [m.replay for m in moe]
            for m, r in zip(moe, replays):
                m.replay = r
            try:
                return forward(*a, **k)
            finally:
                for m, r in zip(moe, outer):
                    m.replay = r

        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    return run_checkpointed
