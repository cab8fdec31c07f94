"""One FSDP2 all-gather per minibatch, not two per micro-batch, where nothing is sharded.

FSDP2's defaults gather a decoder layer's parameters (and, with the bf16 policy, cast them)
before its forward, free them after it, gather them again for its backward and free them after
that: two gathers per layer per micro-batch. A learner process alone on its mesh (one GPU,
wrapped for mixed precision: :func:`~streamrl.parallel.expert_parallel.shard_policy`) shards
nothing, so each gather is only the fp32 -> bf16 cast and copies of the whole model. On the
1.31 B MoE at 4k tokens, four 32k-token micro-batches per optimizer step, those were 8 gathers a
step: ~47 ms of 742 ms device time (device-to-device copies 36 ms, bf16 casts 11 ms; H100,
``RUNS=c4k128p bash tools/gpu/learner_moe.sh``). Gathering once made that step ~3 % faster (median
of five alternated pairs; docs/benchmarks.md, "Learner step").

Within a minibatch the weights do not change, so on a one-rank mesh :class:`MicroBatchGathering`
keeps each layer's gathered bf16 parameters from the first forward to the last backward: one
gather per minibatch, for the memory of one bf16 copy of the model (2.6 GB at 1.31 B). The last
micro-batch's backward frees them as before, so the optimizer step and anything after it
(publishing, checkpoints, a forward-only pass) see the same state as with FSDP's defaults; the
next forward gathers the updated weights. Gradients are still reduced every micro-batch: on one
rank that is the cast to fp32 and a copy, which holding them unreduced in fp32 would cost too.

With several ranks the defaults stay: there the gathers are the point of sharding.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule


class MicroBatchGathering:
    """Gather a one-rank FSDP2 model's parameters once per minibatch.

    Use around the micro-batch loop of one optimizer step::

        with gathering.minibatch():
            for i, m in enumerate(micro):
                loss = ...
                gathering.before_backward(last=i == len(micro) - 1)
                loss.backward()

    A model that is not FSDP-wrapped, or is sharded over several ranks, is left as it is.
    """

    def __init__(self, model: nn.Module, world: int):
        self.active = isinstance(model, FSDPModule) and world == 1
        self.model = model
        # The layers FSDP frees after forward by default; the root module is never freed after
        # its forward (FSDP2's rule for the root), so it is not touched.
        self._layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]

    @contextlib.contextmanager
    def minibatch(self) -> Iterator[None]:
        """Keep the gathered parameters through this block; FSDP's defaults again after it."""
        if not self.active:
            yield
            return
        self._set(keep=True)
        try:
            yield
        finally:
            self._set(keep=False)
            # Freed however the block ended (an exception before the last backward included): a
            # gathered copy left behind would be read, stale, by the forward after the next update.
            for m in (*self._layers, self.model):
                m.reshard()

    def before_backward(self, last: bool) -> None:
        """Call before each micro-batch's backward: the last one frees the gathered parameters."""
        if self.active and last:
            self.model.set_reshard_after_backward(True, recurse=True)

    def _set(self, keep: bool) -> None:
        for layer in self._layers:
            layer.set_reshard_after_forward(not keep, recurse=False)
        self.model.set_reshard_after_backward(not keep, recurse=True)
