"""The reference the packed learner step is measured and tested against: padded rows, full-vocabulary log-softmax.

``streamrl-bench learner --impl padded`` and the packed == padded tests run :func:`padded_step`:
one forward over the minibatch padded to its longest row, ``log_softmax`` in fp32 over
``[B, T, V]`` at every position, then the same objective. One minibatch
(``learner.minibatches = 1``), sequence advantages, no critic. :func:`packed_gradients` is the
packed step's side of the comparison: its gradient, without the optimizer step.
"""
from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from streamrl.algorithms.advantages import group_advantages
from streamrl.algorithms.losses import Normalizers
from streamrl.algorithms.moe_losses import load_balancing_loss, router_z_loss
from streamrl.algorithms.regularizers import token_entropy
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.metrics import mean_over_ranks, read_minibatch_metrics
from streamrl.learner.moe_router import router_metrics
from streamrl.learner.step_loss import compute_policy_loss, kl_term
from streamrl.learner.trainer import Trainer
from streamrl.parallel.grad_clip import clip_grad_norm_on_device
from streamrl.trajectory import to_padded


def padded_routed_experts(batch: TensorDict, t_max: int, layers: int) -> torch.Tensor | None:
    """R3 replay ids aligned with the padded training positions, or None.

    ``routed_experts[j]`` of a trajectory are the experts chosen at the forward position that
    produced response token j, i.e. position ``prompt_len - 1 + j``. Other positions get -1.

    Returns:
        [B, t_max, L, k] int64 or None when the batch has no ``routed_experts``.
    """
    if "routed_experts" not in batch.keys():
        return None
    re = batch["routed_experts"]
    if re.shape[1] != layers:
        raise ValueError(f"routed_experts has {re.shape[1]} layers, the model has {layers} MoE layers")
    p_lens, r_lens = batch["prompt_lens"].tolist(), batch["response_lens"].tolist()
    out = torch.full((len(p_lens), t_max, layers, re.shape[2]), -1, dtype=torch.int64)
    ro = 0
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        out[i, p - 1 : p - 1 + r] = re[ro : ro + r].long()
        ro += r
    return out


def padded_forward(tr: Trainer, model, ids: torch.Tensor, attn: torch.Tensor, replay: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Padded forward of ``model`` (``tr.model`` or its reference): logits [B, T, V] and, for
    the policy, the router logits per MoE layer [B*T, E]. ids, attn: [B, T]; replay: [B, T, L, k] or None."""
    policy = model is tr.model
    for i, b in enumerate(tr.blocks if policy else []):
        b.replay = None if replay is None else replay[:, :, i].reshape(-1, replay.shape[-1]).to(tr.device)
    try:
        out = model(input_ids=ids, attention_mask=attn, use_cache=False)
    finally:
        for b in tr.blocks:
            b.replay = None
    return out.logits, [b.last_router_logits for b in tr.blocks] if policy else []


def packed_gradients(tr: Trainer, batch: TensorDict) -> dict[str, float]:
    """The packed step's gradient of the whole batch's loss left in ``.grad`` (no optimizer
    step) and its metrics: what :meth:`Trainer.step` applies with ``minibatches = 1``."""
    grid, adv, mbs, plans = tr._prepare(batch)
    dropped = float(tr._dropped_rows(adv, grid).float().mean())
    tr.model.train()
    tr.optim.zero_grad(set_to_none=True)
    out: dict[str, float] = {}
    for mb, plan in zip(mbs, plans):
        sums = tr.train_minibatch(batch, grid, adv, mb, plan, optimizer_step=False)
        out = read_minibatch_metrics([sums], tr.world, tr.mesh.dp_group)[0]
    return {**out, "learner/dropped_zero_adv_frac": dropped}


def padded_step(tr: Trainer, batch: TensorDict, optimizer_step: bool = True) -> dict[str, float]:
    """The padded step on ``tr`` for ``batch``.

    Returns the metrics. With ``optimizer_step=False`` the gradients are left in ``.grad`` (zeroed first).
    """
    cfg, lc = tr.cfg, tr.cfg.learner
    if lc.minibatches != 1 or tr.critic or lc.advantage != "sequence":
        raise ValueError("the padded reference step covers minibatches = 1, sequence advantages, no critic")
    temp = cfg.rollout.temperature
    pad = to_padded(batch, tr.pad_id)
    b_all, t_all = pad["input_ids"].shape
    replay = padded_routed_experts(batch, t_all, len(tr.blocks)) if (lc.routing_replay and tr.blocks) else None
    adv = group_advantages(pad["reward"], pad["group_id"], normalize_std=lc.adv_std_norm)
    tr.model.train()
    per = math.ceil(b_all / tr.world)  # this rank's contiguous rows (ranks may get none)
    rows = list(range(b_all))[min(tr.rank * per, b_all) : min((tr.rank + 1) * per, b_all)]
    idx, live = rows or [0], 1.0 if rows else 0.0  # an idle rank runs row 0 with zero weight
    ids = pad["input_ids"][idx].to(tr.device)
    attn = pad["attention_mask"][idx].to(tr.device)
    mask = pad["loss_mask"][idx].to(tr.device) * live
    behav = pad["behaviour_logprobs"][idx].to(tr.device)
    a = adv[idx].to(tr.device) * live
    n_tok = float(pad["loss_mask"].sum().clamp(min=1)) / tr.world
    n_seq = float(b_all) / tr.world
    norm = Normalizers(lc.agg, n_tok, n_seq, float(cfg.rollout.max_new_tokens))
    logits, routers = padded_forward(tr, tr.model, ids, attn, None if replay is None else replay[idx])
    logp = token_logprobs(logits, ids, temp)
    loss, stats = compute_policy_loss(lc, logp, logp.detach(), behav, a, mask, norm)
    metrics = {"learner/loss": float(loss.detach())}
    if tr.ref_model is not None:
        with torch.no_grad():
            ref_logits, _ = padded_forward(tr, tr.ref_model, ids, attn)
            ref_logp = token_logprobs(ref_logits, ids, temp)
        kl = kl_term(lc, logp, ref_logp, mask, norm)
        loss = loss + lc.kl_coef * kl
        metrics["learner/kl_ref"] = float(kl.detach())
    if lc.entropy_coef > 0 or logits.shape[-1] <= 4096:
        with torch.set_grad_enabled(lc.entropy_coef > 0):
            ent = (token_entropy(logits[:, :-1], temp) * mask).sum() / n_tok
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * ent
        metrics["learner/entropy"] = float(ent.detach())
    if routers:
        loss = _add_router_losses(tr, loss, routers, attn.reshape(-1).float() * live, metrics)
    tr.optim.zero_grad(set_to_none=True)
    loss.backward()
    tr.router.drop_grads()
    if optimizer_step:
        norm_t = clip_grad_norm_on_device(tr.model.parameters(), lc.grad_clip, tr.mesh.dp_group)
        metrics["learner/grad_norm"] = float(norm_t)
        tr.optim.step()
        tr.steps_done += 1
    metrics["learner/clip_frac"] = stats["clip_frac"]
    return mean_over_ranks(metrics, tr.world, tr.mesh.dp_group)


def _add_router_losses(tr: Trainer, loss: torch.Tensor, routers: list[torch.Tensor], tok_mask: torch.Tensor,
                       metrics: dict[str, float]) -> torch.Tensor:
    """``loss`` plus the MoE router losses of the padded rows (``tok_mask``: [B*T]); their metrics into ``metrics``."""
    lc = tr.cfg.learner
    aux = load_balancing_loss(routers, tr.num_experts, tr.top_k, tok_mask, tr.mesh.dp_group, scale=tr.world)
    metrics["moe/aux_loss"] = float(aux.detach()) / tr.world
    if lc.aux_loss_coef > 0:
        loss = loss + lc.aux_loss_coef * aux
    if lc.z_loss_coef > 0:
        z = router_z_loss(routers, tok_mask, tr.mesh.dp_group, scale=tr.world)
        loss = loss + lc.z_loss_coef * z
        metrics["moe/z_loss"] = float(z.detach()) / tr.world
    metrics.update(router_metrics(routers, tr.top_k, tok_mask, tr.mesh.dp_group))
    return loss
