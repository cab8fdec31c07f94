"""The learner step as it was before packing: padded rows, full-vocabulary log-softmax.

Kept only as the reference the packed step is measured and tested against
(``streamrl-bench learner --impl padded`` and the packed == padded tests): one forward over the
minibatch padded to its longest row, ``log_softmax`` in fp32 over ``[B, T, V]`` at every
position, then the same objective. One minibatch (``learner.minibatches = 1``), sequence
advantages, no critic.
"""
from __future__ import annotations

import torch
from tensordict import TensorDict

from streamrl.algorithms.advantages import group_advantages
from streamrl.algorithms.moe_losses import load_balancing_loss, router_z_loss
from streamrl.algorithms.regularizers import token_entropy
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.moe_router import router_metrics
from streamrl.learner.objective import compute_policy_loss, kl_term
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


def padded_step(tr, batch: TensorDict, optimizer_step: bool = True) -> dict[str, float]:
    """Today's step on ``tr`` (a :class:`~streamrl.learner.trainer.Trainer`) for ``batch``.

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
    rows = list(range(b_all))
    sl = tr.my_slice(b_all)
    idle = not rows[sl]
    idx = rows[sl] or rows[:1]
    live = 0.0 if idle else 1.0
    ids = pad["input_ids"][idx].to(tr.device)
    attn = pad["attention_mask"][idx].to(tr.device)
    mask = pad["loss_mask"][idx].to(tr.device) * live
    behav = pad["behaviour_logprobs"][idx].to(tr.device)
    a = adv[idx].to(tr.device) * live
    n_tok = float(pad["loss_mask"].sum().clamp(min=1)) / tr.world
    n_seq = float(b_all) / tr.world
    norm_len = float(cfg.rollout.max_new_tokens)
    logits, routers = tr._forward(tr.model, ids, attn, None if replay is None else replay[idx])
    logp = token_logprobs(logits, ids, temp)
    loss, stats = compute_policy_loss(lc, logp, logp.detach(), behav, a, mask, n_tok, n_seq, norm_len)
    metrics = {"learner/loss": float(loss.detach())}
    if tr.ref_model is not None:
        with torch.no_grad():
            ref_logits, _ = tr._forward(tr.ref_model, ids, attn)
            ref_logp = token_logprobs(ref_logits, ids, temp)
        kl = kl_term(lc, logp, ref_logp, mask, n_tok, n_seq, norm_len)
        loss = loss + lc.kl_coef * kl
        metrics["learner/kl_ref"] = float(kl.detach())
    if lc.entropy_coef > 0 or logits.shape[-1] <= 4096:
        with torch.set_grad_enabled(lc.entropy_coef > 0):
            ent = (token_entropy(logits[:, :-1], temp) * mask).sum() / n_tok
        if lc.entropy_coef > 0:
            loss = loss - lc.entropy_coef * ent
        metrics["learner/entropy"] = float(ent.detach())
    if routers:
        tok_mask = attn.reshape(-1).float() * live
        aux = load_balancing_loss(routers, tr.num_experts, tr.top_k, tok_mask, tr.mesh.dp_group, scale=tr.world)
        metrics["moe/aux_loss"] = float(aux.detach()) / tr.world
        if lc.aux_loss_coef > 0:
            loss = loss + lc.aux_loss_coef * aux
        if lc.z_loss_coef > 0:
            z = router_z_loss(routers, tok_mask, tr.mesh.dp_group, scale=tr.world)
            loss = loss + lc.z_loss_coef * z
            metrics["moe/z_loss"] = float(z.detach()) / tr.world
        metrics.update(router_metrics(routers, tr.top_k, tok_mask, tr.mesh.dp_group))
    tr.optim.zero_grad(set_to_none=True)
    loss.backward()
    tr.router.drop_grads()
    if optimizer_step:
        from streamrl.learner.trainer import clip_grad_norm

        metrics["learner/grad_norm"] = clip_grad_norm(tr.model.parameters(), lc.grad_clip, tr.mesh.dp_group)
        tr.optim.step()
        tr.steps_done += 1
    metrics["learner/clip_frac"] = stats["clip_frac"]
    return tr._reduce_metrics(metrics)
