"""Policy losses with off-policy correction for stale, asynchronously generated samples.

Notation (all [B, T] over next-token positions, masked by ``mask``):
    logp        log pi_theta(token), with gradient
    prox_logp   log pi_prox(token): the learner's policy before this update (no gradient)
    behav_logp  log mu(token): the (possibly stale) policy that sampled the token

Decoupled PPO (AReaL): the PPO ratio is taken against the proximal policy,
``r = pi_theta / pi_prox``, while the off-policy gap ``pi_prox / mu`` is corrected by an
importance weight (truncated: ``min(w, C)``, Espeholt et al.; or masked: ``w * 1[w <= C]``).
With one optimizer step per batch, pi_prox == pi_theta numerically, r == 1 and the
correction is exactly the importance weight on the policy gradient.

Every function here is pure: tensors in, tensors (and float stats) out. Per-token loss
matrices are reduced by :func:`aggregate`; the V-trace estimator lives in
:mod:`streamrl.algorithms.vtrace`, KL / entropy terms in :mod:`streamrl.algorithms.regularizers`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_MODES = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis")


def masked_token_mean(x: torch.Tensor, mask: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Sum of ``x * mask`` over all tokens divided by ``denom`` (default: ``mask.sum()``)."""
    d = mask.sum().clamp(min=1.0) if denom is None else denom
    return (x * mask).sum() / d


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss_mat: [B, T] per-token loss.
        mask: [B, T] 1.0 on tokens that count (a masked token is out of every denominator).
        mode: ``token-mean`` (sum / all tokens of the batch, DAPO), ``seq-mean-token-mean``
            (mean over sequences of each sequence's token mean, GRPO paper),
            ``seq-mean-token-sum-norm`` (each sequence's token sum / ``norm_len``, then mean over
            sequences, Dr.GRPO: no length bias).
        num_tokens: global token count for ``token-mean`` (default: ``mask.sum()``); pass the
            count over all ranks when the batch is split across data-parallel ranks.
        num_seqs: global sequence count for the seq-mean modes (default: ``B``).
        norm_len: the constant of ``seq-mean-token-sum-norm`` (default: ``T``).

    Examples:
        >>> aggregate(torch.tensor([[1., 3.]]), torch.tensor([[1., 0.]]))
        tensor(1.)
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation mode {mode!r} unknown; known: {AGG_MODES}")
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_token_mean(loss_mat, mask, num_tokens)
    n_seq = float(loss_mat.shape[0]) if num_seqs is None else num_seqs
    n_seq = max(n_seq, 1.0)
    per_seq = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    else:
        per_seq = per_seq / float(norm_len if norm_len is not None else loss_mat.shape[-1])
    return per_seq.sum() / n_seq


def ppo_clip_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with clip-higher (DAPO) and dual-clip (Ye et al. 2020).

    ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c > 1``
    a negative advantage's loss is further capped at ``c |A|`` (``min(loss, -c A)`` for A < 0),
    so a huge ratio on a bad token cannot blow the update up.

    Args:
        logp, old_logp: [B, T]; the ratio is ``exp(logp - old_logp)`` (old_logp gets no gradient).
        advantages: [B] (broadcast over tokens) or [B, T].
    Returns:
        (loss [B, T], ratio [B, T], clipped [B, T] bool: the clip (or dual clip) was active).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp.detach())
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip = {dual_clip!r}: must be > 1")
        cap = -adv * dual_clip
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
        clipped = clipped | dual
    return loss, ratio, clipped


def importance_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-tis",
    cap: float = 2.0,
    low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy correction weights for ``pi_prox / mu`` (no gradient).

    Modes: ``none`` (all ones); ``token-tis`` ``min(w_t, cap)``; ``token-mis`` ``w_t`` where
    ``low <= w_t <= cap`` else 0 (the token leaves the gradient); ``seq-tis`` / ``seq-mis``
    the same on the sequence weight ``exp(sum_t log w_t)`` over the masked tokens, broadcast
    to every token of the sequence.

    Args:
        prox_logp, behav_logp: [B, T]; mask: [B, T].
    Returns:
        (weight [B, T], raw [B, T]: the untruncated weight, for diagnostics).
    """
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode {mode!r} unknown; known: {IS_MODES}")
    with torch.no_grad():
        log_w = (prox_logp - behav_logp).float() * mask
        if mode == "none":
            ones = torch.ones_like(log_w)
            return ones, ones
        if mode.startswith("seq"):
            log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
        raw = torch.exp(log_w.clamp(max=20.0))
        if mode.endswith("tis"):
            w = raw.clamp(max=cap)
        else:
            w = raw * ((raw <= cap) & (raw >= low)).to(raw.dtype)
    return w, raw


@dataclass(frozen=True)
class PolicyLossSpec:
    """PPO-clip and off-policy-correction settings of :func:`policy_loss`.

    ``clip_low``/``clip_high``: the ratio's clip range (clip-higher, DAPO); ``dual_clip``: the
    cap ``c > 1`` of a negative advantage's loss, or None; ``is_mode``/``is_cap``/``is_low``:
    the correction of ``pi_prox / mu`` (:func:`importance_weights`); ``coupled``: standard PPO
    that ignores staleness (the ratio taken against the behaviour policy, no extra weight).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    is_mode: str = "token-tis"
    is_cap: float = 2.0
    is_low: float = 0.0
    coupled: bool = False


@dataclass(frozen=True)
class Normalizers:
    """How a per-token loss becomes a scalar (the arguments of :func:`aggregate`): the mode
    (``learner.agg``) and the global counts it divides by (over all data-parallel ranks,
    divided by their number), None for this batch's own counts."""

    agg: str = "token-mean"
    num_tokens: float | None = None
    num_seqs: float | None = None
    norm_len: float | None = None

    def reduce(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:func:`aggregate` of ``loss_mat`` [B, T] under ``mask`` [B, T] with these counts."""
        return aggregate(loss_mat, mask, self.agg, self.num_tokens, self.num_seqs, self.norm_len)


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: PolicyLossSpec = PolicyLossSpec(),
    norm: Normalizers = Normalizers(),
    tensor_stats: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip against the proximal policy, weighted by an off-policy correction, aggregated.

    ``tensor_stats``: the stats as 0-dim device tensors, computed without waiting for the
    device (the learner's loop reads them once per step), instead of floats.

    Args:
        logp, prox_logp, behav_logp: [B, T]; advantages: [B] or [B, T]; mask: [B, T].
        spec: the clip and correction settings; norm: the reduction and its global counts.
    Returns:
        (loss scalar, stats: ``clip_frac``, ``is_weight_mean``, ``is_truncated_frac``).
    """
    mask = mask.to(logp.dtype)
    old = behav_logp if spec.coupled else prox_logp
    tok_loss, ratio, clipped = ppo_clip_token_loss(logp, old, advantages, spec.clip_low, spec.clip_high,
                                                   spec.dual_clip)
    w, raw = importance_weights(prox_logp, behav_logp, mask, "none" if spec.coupled else spec.is_mode,
                                spec.is_cap, spec.is_low)
    loss = norm.reduce(tok_loss * w, mask)
    if tensor_stats:
        return loss, masked_stats(clipped, raw, mask, spec.is_cap if spec.is_mode != "none" else None)
    with torch.no_grad():
        m = mask.bool()
        n = max(int(m.sum()), 1)
        stats = {
            "clip_frac": float(clipped[m].sum()) / n,
            "is_weight_mean": float(raw[m].mean()) if m.any() else 1.0,
            "is_truncated_frac": float((raw[m] > spec.is_cap).sum()) / n if spec.is_mode != "none" else 0.0,
        }
    return loss, stats


@torch.no_grad()
def masked_stats(clipped: torch.Tensor, raw: torch.Tensor, mask: torch.Tensor,
                 is_cap: float | None) -> dict[str, torch.Tensor]:
    """``clip_frac``, ``is_weight_mean`` (1 without tokens), ``is_truncated_frac`` (0 when
    ``is_cap`` is None) over the masked tokens, as 0-dim tensors; no boolean indexing, so no
    wait for the device. clipped, raw: [B, T] (raw may be [B, 1]); mask: [B, T]."""
    m = mask.bool()
    n = m.sum().clamp(min=1).to(torch.float32)
    raw_m = torch.where(m, raw, torch.zeros((), dtype=raw.dtype, device=raw.device))
    weight_mean = torch.where(m.any(), raw_m.sum() / n, torch.ones((), device=raw.device))
    trunc = ((raw_m > is_cap) & m).sum() / n if is_cap is not None else torch.zeros((), device=raw.device)
    return {"clip_frac": (clipped & m).sum() / n, "is_weight_mean": weight_mean, "is_truncated_frac": trunc}


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_seqs: float | None = None,
    seq_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO-clip on the length-normalised sequence ratio.

    ``s_i = exp(mean_t (logp - old_logp))``; the token form ``s_i * pi_t / sg(pi_t)`` carries the
    gradient (equal value, gradient of the mean log-ratio). Clip ranges are tiny because
    ``s_i`` is a geometric mean. Reduced as a mean over sequences.

    Args:
        logp, old_logp: [B, T]; advantages: [B]; mask: [B, T].
        seq_weight: [B] off-policy weight per sequence (no gradient), or None.
    Returns:
        (loss scalar, stats with ``clip_frac`` over sequences and ``seq_ratio_mean``).
    """
    mask = mask.to(logp.dtype)
    n_tok = mask.sum(-1).clamp(min=1.0)
    log_s = ((logp - old_logp.detach()) * mask).sum(-1) / n_tok  # [B]
    s = torch.exp(log_s)
    l1 = -advantages * s
    l2 = -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    seq_loss = torch.maximum(l1, l2) * (mask.sum(-1) > 0).to(logp.dtype)
    if seq_weight is not None:
        seq_loss = seq_loss * seq_weight.detach()
    n = float(logp.shape[0]) if num_seqs is None else num_seqs
    loss = seq_loss.sum() / max(n, 1.0)
    with torch.no_grad():
        stats = {"clip_frac": float((l2 > l1).float().mean()), "seq_ratio_mean": float(s.mean())}
    return loss, stats
