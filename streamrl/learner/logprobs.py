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
   anyway) are kept for the backward instead: the recompute is one of the head's four
   matmuls, ~6 % of a SmolLM2 shared-prompt step on CPU.

The swap happens inside the root module's forward, so under FSDP2 the head weight is the
all-gathered parameter there, and its gradient is reduced like any other.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
        (else it is returned as zeros and gets no gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        dt = _acc_dtype(hidden)
        logp = hidden.new_empty(n, dtype=dt)
        ent = hidden.new_zeros(n, dtype=dt)
        lse_all = hidden.new_empty(n, dtype=dt)
        kept = None  # [n, V] logits of a single chunk, kept for the backward
        for lo in range(0, n, chunk):
            z = _chunk_logits(hidden[lo : lo + chunk], weight, bias, temperature)
            if n <= chunk:
                kept = z
            lse = torch.logsumexp(z, -1)
            lse_all[lo : lo + chunk] = lse
            logp[lo : lo + chunk] = z.gather(-1, targets[lo : lo + chunk, None]).squeeze(-1) - lse
            if with_entropy:
                ent[lo : lo + chunk] = lse - (torch.softmax(z, -1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, ent, kept)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse_all, ent, kept = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:  # the zeros returned for the entropy are constants
            g_ent = None
        g_h = torch.zeros_like(hidden) if need_h else None
        dt = _acc_dtype(hidden)
        g_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        g_b = torch.zeros(weight.shape[0], dtype=dt, device=weight.device) if need_b and bias is not None else None
        if g_logp is None and g_ent is None:
            return g_h, g_w, g_b, None, None, None, None
        for lo in range(0, hidden.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            z = kept if kept is not None else _chunk_logits(hidden[sl], weight, bias, t)
            logp_all = z - lse_all[sl, None]
            p = logp_all.exp()
            g_z = torch.zeros_like(z)
            if g_logp is not None:
                g_z -= p * g_logp[sl, None]
                g_z.scatter_add_(-1, targets[sl, None], g_logp[sl, None].to(dt))
            if g_ent is not None:
                g_z -= p * (logp_all + ent[sl, None]) * g_ent[sl, None]
            g_z = (g_z / t).to(weight.dtype)
            if need_h:
                g_h[sl] = g_z @ weight
            if need_w:
                g_w += (g_z.t() @ hidden[sl]).to(dt)
            if g_b is not None:
                g_b += g_z.to(dt).sum(0)
        return (g_h, None if g_w is None else g_w.to(weight.dtype),
                None if g_b is None else g_b.to(weight.dtype), None, None, None, None)


def _acc_dtype(h: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 models (as ``logits.float()``), fp64 stays fp64."""
    return torch.promote_types(h.dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias, temperature: float) -> torch.Tensor:
    """Logits / temperature of one chunk in the accumulation dtype, rounded exactly as
    ``lm_head(h).float()`` would be."""
    z = h @ weight.t()
    if bias is not None:
        z = z + bias
    return z.to(_acc_dtype(h)) / temperature


def token_logprobs_chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk: int, with_entropy: bool = False, bias: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [n], entropy [n])`` for hidden [n, H] and the head ``weight`` [V, H] (see the class)."""
    return ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk), bool(with_entropy))


@dataclass
class HeadRequest:
    """What the swapped LM head computes at the kept positions (set for one forward).

    targets: [n] tokens predicted at the kept positions; value_head: the critic's head or None.
    """

    targets: torch.Tensor
    temperature: float
    chunk: int
    with_entropy: bool
    value_head: nn.Module | None = None


def _head_forward(head: nn.Linear, req: HeadRequest, hidden: torch.Tensor) -> torch.Tensor:
    """Replacement LM-head forward: hidden [1, n, H] -> [1, n, 3] (logp, entropy, value)."""
    h = hidden[0]
    logp, ent = token_logprobs_chunked(h, head.weight, req.targets, req.temperature, req.chunk,
                                       req.with_entropy, head.bias)
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
