"""Log-probs and entropy of chosen tokens without a full-vocabulary tensor.

Why: ``log_softmax(logits[B, T, V].float())`` over every position is the learner's largest
tensor (SmolLM2: V = 49,152, so 64 x 84 positions are 1 GB per fp32 copy, and autograd keeps
several). Only the positions that predict response tokens take part in the loss, and only the
chosen token's log-prob (and the entropy) is needed. So:

1. the model runs with ``logits_to_keep = <response positions>`` (transformers slices the
   final hidden states there) and its LM head is swapped, for that call, for
   :func:`_head_forward`, which returns per-token ``(logp, entropy, value)`` instead of logits;
2. :class:`ChunkedTokenLogprobs` applies the head weight in chunks of ``chunk`` rows: the
   forward keeps no ``[n, V]`` tensor, the backward recomputes each chunk's logits and forms
   the gradient ``(onehot - p) * g_logp - p * (log p + H) * g_H`` directly. When all ``n``
   rows fit in one chunk, that chunk's logits (the ``[chunk, V]`` temporary the bound allows
   anyway, in the weight dtype: bf16 for a bf16 model) are kept for the backward instead: the
   recompute is one of the head's four matmuls, ~6 % of a SmolLM2 shared-prompt step on CPU.
   Eager, the backward then writes the logits' gradient into those kept logits, and on CPU they
   live in a reused workspace: each fresh ``[c, V]`` tensor there is a new mmap whose page faults
   cost as much as several passes over it (:class:`_LogitsWorkspace`).
3. With ``learner.compile`` each chunk's elementwise work is ``torch.compile``d: the forward
   is one matmul plus one reduction kernel over its output, the backward one matmul (the
   recompute), one elementwise kernel writing the logits' gradient in the weight dtype, and the
   two gradient matmuls. Eager, the same math is ~10 separate fp32 ``[chunk, V]`` passes (on the
   H200 at 4k tokens most of the step's 60 ms of elementwise kernels).

The swap happens inside the root module's forward, so under FSDP2 the head weight is the
all-gathered parameter there, and its gradient is reduced like any other.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from streamrl.models.lora import head_weight


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the next tokens from full logits (evaluation and the padded reference step).

    Args:
        logits: [B, T, V] model outputs.
        input_ids: [B, T] tokens.
    Returns:
        [B, T-1]: log softmax(logits[:, t] / temperature)[input_ids[:, t+1]].
    """
    lp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(logp [n], entropy [n])`` of ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args (forward):
        hidden: [n, H]; weight: [V, H]; bias: [V] or None; targets: [n] int64 token ids;
        temperature: float; chunk: rows per chunk; with_entropy: compute the entropy too
        (else it is returned as zeros and gets no gradient); compiled: run each chunk's
        elementwise work as one ``torch.compile``d kernel (:func:`_chunk_kernels`).

    Per chunk the forward is one matmul (the head's logits in the weight dtype, ``[c, V]``) and
    one pass over them (:func:`_chunk_stats`); the backward recomputes that matmul, forms the
    logits' gradient in one pass (:func:`_chunk_grad`) and runs the two gradient matmuls.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, compiled):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        dt = _acc_dtype(hidden)
        stats, _ = _chunk_kernels(compiled)
        logp = hidden.new_empty(n, dtype=dt)
        ent = hidden.new_zeros(n, dtype=dt)
        lse_all = hidden.new_empty(n, dtype=dt)
        kept = None  # [n, V] head output (weight dtype) of a single chunk, kept for the backward
        for lo in range(0, n, chunk):
            sl = slice(lo, lo + chunk)
            if n <= chunk and any(ctx.needs_input_grad[:3]):
                raw = kept = _LOGITS_WORKSPACE.linear(ctx, hidden, weight, bias)
            else:
                raw = F.linear(hidden[sl], weight, bias)
            # eager: the reductions' [rows, V] temporaries in blocks of a few MB, which malloc
            # serves again from its heap (a [chunk, V] temporary is a fresh mmap, page faults each time)
            rows = raw.shape[0]
            step = rows if compiled else min(rows, _stats_rows(raw.shape[1]))
            for blo in range(0, rows, step):
                bl = slice(lo + blo, lo + min(blo + step, rows))
                logp[bl], lse_all[bl], e = stats(*_rows_dynamic(compiled, raw[blo : blo + step], targets[bl]),
                                                 temperature, with_entropy)
                if with_entropy:
                    ent[bl] = e
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, ent, kept)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.compiled = temperature, chunk, with_entropy, compiled
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse_all, ent, kept = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:  # the zeros returned for the entropy are constants
            g_ent = None
        dt = _acc_dtype(hidden)
        if g_logp is None and g_ent is None:
            return (torch.zeros_like(hidden) if need_h else None,
                    torch.zeros_like(weight) if need_w else None,
                    torch.zeros_like(bias) if need_b and bias is not None else None, None, None, None, None, None)
        _, grad = _chunk_kernels(ctx.compiled)
        if kept is not None:  # one chunk: no zero-filled accumulators, the GEMMs write the gradients
            g_z = grad(*_rows_dynamic(ctx.compiled, kept, targets, lse_all, ent, g_logp, g_ent), ctx.temperature,
                       overwrite=not ctx.compiled)
            out = (torch.mm(g_z, weight) if need_h else None,
                   (g_z.t() @ hidden).to(weight.dtype) if need_w else None,
                   g_z.sum(0, dtype=dt).to(weight.dtype) if need_b and bias is not None else None,
                   None, None, None, None, None)
            _LOGITS_WORKSPACE.release(ctx)
            return out
        g_h = torch.zeros_like(hidden) if need_h else None
        g_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        g_b = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) if need_b and bias is not None else None
        for lo in range(0, hidden.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            raw = F.linear(hidden[sl], weight, bias)
            rows = [raw, targets[sl], lse_all[sl], ent[sl],
                    None if g_logp is None else g_logp[sl], None if g_ent is None else g_ent[sl]]
            g_z = grad(*_rows_dynamic(ctx.compiled, *rows), ctx.temperature,
                       overwrite=not ctx.compiled)  # [c, V], weight dtype; raw is this chunk's own
            if need_h:
                torch.mm(g_z, weight, out=g_h[sl])
            if need_w:
                if g_w.dtype == g_z.dtype:  # fp32/fp64 models: accumulate inside the GEMM
                    g_w.addmm_(g_z.t(), hidden[sl])
                else:  # bf16/fp16: a low-precision partial, summed in fp32 (one mixed-dtype add)
                    g_w.add_(g_z.t() @ hidden[sl])
            if g_b is not None:
                g_b.add_(g_z.sum(0, dtype=dt))
        return (g_h, None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(weight.dtype), None, None, None, None, None)


class _LogitsWorkspace:
    """One reusable CPU buffer for the single chunk's ``[n, V]`` logits kept for the backward.

    Why: a fresh ``[768, 49152]`` fp32 tensor is a new mmap every micro-batch, and first-touching
    its 150 MB (page faults) cost about a third of the head's forward GEMM on the 2-core machine.
    The buffer is lent to one autograd node at a time: it is free again once that node's backward
    has run (:meth:`release`) or the node is gone (a graph dropped without a backward); while it
    is lent, a second forward gets a fresh tensor. Reusing it bumps its version counter, so a
    stale graph that still saves it fails loudly in its backward instead of reading new logits.
    GPUs have the caching allocator: there the buffer is never used.
    """

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.holder = None  # weakref to the autograd ctx the buffer is lent to

    def linear(self, ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(hidden [n, H], weight [V, H], bias)`` -> [n, V], into the buffer when it is free."""
        n, v = hidden.shape[0], weight.shape[0]
        lent = self.holder is not None and self.holder() is not None
        if lent or hidden.device.type != "cpu" or hidden.dtype != weight.dtype:
            return F.linear(hidden, weight, bias)
        if self.buf is None or self.buf.numel() < n * v or self.buf.dtype != weight.dtype:
            self.buf = None  # the old one goes before the new one is allocated
            self.buf = torch.empty(n * v, dtype=weight.dtype)
        out = self.buf[: n * v].view(n, v)
        if bias is None:
            torch.mm(hidden, weight.t(), out=out)
        else:
            torch.addmm(bias, hidden, weight.t(), out=out)
        self.holder = weakref.ref(ctx)
        return out

    def release(self, ctx) -> None:
        """``ctx``'s backward is done with the buffer."""
        if self.holder is not None and self.holder() is ctx:
            self.holder = None


_LOGITS_WORKSPACE = _LogitsWorkspace()

_STATS_BLOCK_BYTES = 16 << 20
"""Bytes of one fp32 ``[rows, V]`` temporary of the eager forward's reductions: under glibc's
32 MiB ceiling for serving a freed block again from the heap instead of a new mmap."""


def _stats_rows(vocab: int) -> int:
    """Rows per block of the eager forward's reductions (at least 1)."""
    return max(1, _STATS_BLOCK_BYTES // (4 * vocab))


def _acc_dtype(h: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 models (as ``logits.float()``), fp64 stays fp64."""
    return torch.promote_types(h.dtype, torch.float32)


def _scaled(raw: torch.Tensor, temperature: float) -> torch.Tensor:
    """Head output [c, V] -> logits / temperature in the accumulation dtype."""
    z = raw.to(_acc_dtype(raw))
    return z if temperature == 1.0 else z / temperature


def _chunk_stats(raw: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """Per-row ``(logp, lse, entropy or None)`` [c] of one chunk's head output ``raw`` [c, V].

    ``raw`` is rounded to the weight dtype exactly as ``lm_head(h)`` is; everything after is in
    the accumulation dtype, as ``lm_head(h).float()``. The entropy uses the logsumexp already
    computed (``p = exp(z - lse)``), so compiled, the chunk is one reduction kernel that reads
    ``raw`` and never writes a ``[c, V]`` fp32 tensor.
    """
    z = _scaled(raw, temperature)
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logp, lse, None
    return logp, lse, lse - (torch.exp(z - lse[:, None]) * z).sum(-1)


def _chunk_grad(raw: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float,
                overwrite: bool = False) -> torch.Tensor:
    """Gradient of the chunk's head output ``raw`` [c, V] (returned in ``raw``'s dtype).

    ``d/dz [g_logp * logp_y + g_H * H] = (onehot_y - p) * g_logp - p * (log p + H) * g_H``, then
    ``/ temperature``; ``lse``, ``ent``, ``g_*``: [c]; at least one ``g_*`` is given (None
    contributes nothing). ``overwrite``: ``raw`` is not needed afterwards, so eager mode writes the
    gradient into it (the same operations in the same order, without the ``[c, V]`` fp32
    temporaries: each is a fresh ~150 MB allocation, page faults included, at 768 x 49,152).
    """
    z = _scaled(raw, temperature)
    if not torch.compiler.is_compiling():
        return _chunk_grad_inplace(z if overwrite or z is not raw else z.clone(), raw.dtype, targets, lse, ent,
                                   g_logp, g_ent, temperature)
    logp_all = z - lse[:, None]
    p = logp_all.exp()
    g_z = None
    if g_ent is not None:
        g_z = p * (logp_all + ent[:, None]) * -g_ent[:, None].to(z.dtype)
    if g_logp is not None:
        g_lp = g_logp[:, None].to(z.dtype)
        # the one-hot as a comparison with the column index keeps the whole chunk in one
        # fused elementwise kernel (a scatter would split it and write [c, V] fp32 twice)
        hit = torch.arange(z.shape[-1], device=z.device) == targets[:, None]
        term = (hit.to(z.dtype) - p) * g_lp
        g_z = term if g_z is None else term + g_z
    if temperature != 1.0:
        g_z = g_z / temperature
    return g_z.to(raw.dtype)


def _chunk_grad_inplace(z: torch.Tensor, out_dtype: torch.dtype, targets: torch.Tensor, lse: torch.Tensor,
                        ent: torch.Tensor, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None,
                        temperature: float) -> torch.Tensor:
    """Eager :func:`_chunk_grad` in the buffer of ``z`` [c, V] (scaled logits, overwritten): at most
    one more ``[c, V]`` tensor (``p``, with the entropy). The one-hot term is a scatter of ``c``
    elements (cheaper than a ``[c, V]`` compare)."""
    logp_all = z.sub_(lse[:, None])
    g_z = None
    if g_ent is not None:
        p = logp_all.exp()
        g_z = logp_all.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None].to(z.dtype))  # p * (log p + H) * -g_H
    else:
        p = logp_all.exp_()
    if g_logp is not None:
        g_lp = g_logp[:, None].to(z.dtype)
        term = p.mul_(-g_lp)
        term.scatter_add_(-1, targets[:, None], g_lp)
        g_z = term if g_z is None else term.add_(g_z)
    if temperature != 1.0:
        g_z = g_z.div_(temperature)
    return g_z.to(out_dtype)


_compiled_kernels = None


def _chunk_kernels(compiled: bool):
    """``(stats, grad)``: the chunk functions, eager or compiled (once per process).

    ``dynamic=None`` with the row dim marked by :func:`_rows_dynamic`: the last, shorter chunk
    and micro-batches of new lengths reuse the graphs (no recompile per row count).
    """
    global _compiled_kernels
    if not compiled:
        return _chunk_stats, _chunk_grad
    if _compiled_kernels is None:
        _compiled_kernels = (torch.compile(_chunk_stats, dynamic=None), torch.compile(_chunk_grad, dynamic=None))
    return _compiled_kernels


def _rows_dynamic(compiled: bool, *tensors):
    """The tensors, with their row dim (0) marked dynamic for the compiled kernels."""
    if compiled:
        for t in tensors:
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
    return tensors


def token_logprobs_chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk: int, with_entropy: bool = False, bias: torch.Tensor | None = None,
                           compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [n], entropy [n])`` for hidden [n, H] and the head ``weight`` [V, H] (see the class)."""
    return ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk),
                                      bool(with_entropy), bool(compiled))


@dataclass
class HeadRequest:
    """What the swapped LM head computes at the kept positions (set for one forward).

    targets: [n] tokens predicted at the kept positions; value_head: the critic's head or None;
    compiled: each chunk's elementwise work as compiled kernels (the trainer sets ``learner.compile``).
    """

    targets: torch.Tensor
    temperature: float
    chunk: int
    with_entropy: bool
    value_head: nn.Module | None = None
    compiled: bool = False


def _head_forward(head: nn.Linear, req: HeadRequest, hidden: torch.Tensor) -> torch.Tensor:
    """Replacement LM-head forward: hidden [1, n, H] -> [1, n, 3] (logp, entropy, value)."""
    h = hidden[0]
    logp, ent = token_logprobs_chunked(h, head_weight(head), req.targets, req.temperature, req.chunk,
                                       req.with_entropy, head.bias, req.compiled)
    value = req.value_head(h) if req.value_head is not None else torch.zeros_like(logp)
    return torch.stack([logp, ent, value.float()], -1)[None]


@contextlib.contextmanager
def response_head(model: nn.Module, req: HeadRequest):
    """Within the block, ``model.lm_head`` returns ``(logp, entropy, value)`` per kept position.

    The forward is swapped on the instance (parameter names and FSDP hooks stay as they are).
    """
    head = model.get_output_embeddings()
    head.forward = lambda hidden: _head_forward(head, req, hidden)
    try:
        yield
    finally:
        del head.forward
