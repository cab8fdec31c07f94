"""The learner's model, expert parallel + FSDP2 sharding, optimizer and one policy-gradient step.

Every rank holds the full packed batch (broadcast from rank 0), computes advantages on all
of it (cheap, and identical everywhere), and trains on its own slice of trajectories.
Losses are normalised by *global* counts (tokens or sequences) divided by the world size,
because FSDP2's gradient reduce-scatter averages over ranks; the MoE router losses
all-reduce their statistics so their gradient is that of the global loss too.
"""
from __future__ import annotations

import copy
import math
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from streamrl.algorithms.advantages import group_advantages, token_group_advantages
from streamrl.algorithms.moe_losses import load_balancing_loss, router_z_loss
from streamrl.algorithms.regularizers import token_entropy
from streamrl.config import Config, ConfigError
from streamrl.learner.critic import (attach_value_head, critic_metrics, critic_targets, is_critic_param,
                                     response_mdp, value_head, value_loss, whiten_advantages)
from streamrl.learner.moe_router import RouterController, router_metrics
from streamrl.learner.objective import compute_policy_loss, kl_term
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.models.moe import find_moe_blocks
from streamrl.parallel.expert_parallel import full_parameter, global_param_specs, parallelize
from streamrl.parallel.mesh import build_mesh
from streamrl.trajectory import to_padded


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the next tokens.

    Args:
        logits: [B, T, V] model outputs.
        input_ids: [B, T] tokens.
    Returns:
        [B, T-1]: log softmax(logits[:, t] / temperature)[input_ids[:, t+1]].
    """
    lp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return lp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def moe_router_stats(router_logits, top_k: int) -> dict[str, float]:
    """Per-layer router metrics of one process (kept for callers of the skeleton)."""
    return router_metrics(list(router_logits or []), top_k)


def padded_routed_experts(batch: TensorDict, t_max: int, layers: int) -> torch.Tensor | None:
    """R3 replay ids aligned with the training positions, or None.

    ``routed_experts[j]`` of a trajectory are the experts chosen at the forward position that
    produced response token j, i.e. position ``prompt_len - 1 + j`` (the position whose
    log-prob is trained). Other positions get -1 (route normally).

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


def clip_grad_norm(params, max_norm: float, group=None) -> float:
    """Clip gradients to a global L2 norm; returns the norm before clipping.

    Works across FSDP meshes of different shapes (dense params over all ranks, experts over
    ``dp_shard``) where ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensor meshes: every
    rank holds a disjoint shard of every gradient, so the squared norm is a sum over ranks.
    """
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = sum((x.detach().float() ** 2).sum() for x in local) if local else torch.zeros(())
    sq = torch.as_tensor(sq, dtype=torch.float64).reshape(1).cpu()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for x in local:
            x.mul_(coef)
    return norm


class Trainer:
    """Model + expert parallel + FSDP2 + AdamW; :meth:`step` trains on one packed batch."""

    def __init__(self, cfg: Config):
        import torch.distributed as dist

        self.cfg = cfg
        lc = cfg.learner
        if lc.advantage == "token" and not cfg.rollout.token_rewards:
            raise ConfigError("config field 'learner.advantage' = 'token': needs rollout.token_rewards = true "
                              "(the per-token rewards it is computed from)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Same seed on every rank: identical initial weights before sharding.
        model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        self.tokenizer = tok
        self.pad_id = tok.pad_token_id
        self.device = torch.device("cpu")
        if lc.device.startswith("cuda"):
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        hf_blocks = find_moe_blocks(model)
        self.num_experts = int(hf_blocks[0][1].experts.gate_up_proj.shape[0]) if hf_blocks else 0
        self.is_moe = bool(hf_blocks)
        self.mesh = build_mesh(lc.ep, self.device.type, self.num_experts)
        self.ref_model = None
        if lc.kl_coef > 0:
            self.ref_model = copy.deepcopy(model)
            parallelize(self.ref_model, self.mesh, self.device, lc.experts_impl, lc.mixed_precision)
            self.ref_model.requires_grad_(False).eval()
        # The critic's head joins the model before sharding: the root fully_shard covers it,
        # the optimizer and DCP checkpoints see it like any other parameter.
        self.critic = lc.loss == "vtrace"
        if self.critic:
            attach_value_head(model)
        self.blocks = parallelize(model, self.mesh, self.device, lc.experts_impl, lc.mixed_precision,
                                  compile_layers=lc.compile)
        self.model = model
        # Names and global shapes: the weights manifest is built from these (no value head:
        # rollout engines have no such parameter).
        self.param_specs = [s for s in global_param_specs(model, lc.ep) if not is_critic_param(s[0])]
        self.router = RouterController(model, self.blocks, lc)
        self.optim = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.99))
        self.steps_done = 0

    def my_slice(self, n: int) -> slice:
        """Contiguous trajectory range of this rank among ``n`` (ranks may get 0)."""
        per = math.ceil(n / self.world)
        lo = min(self.rank * per, n)
        return slice(lo, min(lo + per, n))

    def _forward(self, model, ids, attn, replay=None):
        """Logits [B, T, V] and per-layer router logits [B*T, E] (replay: [B, T, L, k] or None)."""
        logits, routers, _ = self._forward_values(model, ids, attn, replay, values=False)
        return logits, routers

    def _forward_values(self, model, ids, attn, replay=None, values=True):
        """(logits [B, T, V], router logits per layer [B*T, E], values [B, T-1] or None).

        ``values[:, t]`` is V at the position that predicts token t+1 (the ``token_logprobs``
        grid); computed from the final hidden state only when asked and the critic is on.
        """
        values = values and self.critic and model is self.model
        for i, b in enumerate(self.blocks if model is self.model else []):
            b.replay = None if replay is None else replay[:, :, i].reshape(-1, replay.shape[-1]).to(self.device)
        try:
            out = model(input_ids=ids, attention_mask=attn, use_cache=False, output_hidden_states=values)
        finally:
            for b in self.blocks:
                b.replay = None
        routers = [b.last_router_logits for b in self.blocks] if model is self.model else []
        v = value_head(model)(out.hidden_states[-1][:, :-1]) if values else None
        return out.logits, routers, v

    def step(self, batch: TensorDict) -> dict[str, float]:
        """One learner step (``minibatches`` optimizer steps) on a packed batch, same on every rank."""
        t0 = time.perf_counter()
        cfg, lc = self.cfg, self.cfg.learner
        temp = cfg.rollout.temperature
        padded = to_padded(batch, self.pad_id)
        b_all, t_all = padded["input_ids"].shape
        replay = padded_routed_experts(batch, t_all, len(self.blocks)) if (lc.routing_replay and self.blocks) else None
        adv = self._advantages(padded)
        if self.critic:  # per-token MDP of each response; group advantages are not used
            padded["tok_reward"], padded["tok_done"], padded["resp"] = response_mdp(
                batch["prompt_lens"].tolist(), batch["response_lens"].tolist(), padded["reward"], t_all - 1)
        self.model.train()
        agg: dict[str, float] = {}
        per_mb = math.ceil(b_all / lc.minibatches)
        mbs = [list(range(j, min(j + per_mb, b_all))) for j in range(0, b_all, per_mb)]
        # The proximal policy: the weights before this batch's first update.
        prox_all = None
        if lc.minibatches > 1 and lc.loss != "ppo_coupled":
            with torch.no_grad():
                prox_all = {}
                for j, mb in enumerate(mbs):
                    idx = self._rank_rows(mb)
                    ids = padded["input_ids"][idx].to(self.device)
                    logits, _ = self._forward(self.model, ids, padded["attention_mask"][idx].to(self.device),
                                              None if replay is None else replay[idx])
                    prox_all[j] = token_logprobs(logits, ids, temp)
        for j, mb in enumerate(mbs):
            m = self._train_minibatch(padded, adv, mb, replay, None if prox_all is None else prox_all[j])
            for k, v in m.items():
                agg[k] = agg.get(k, 0.0) + v / len(mbs)
        metrics = {
            **agg,
            "learner/reward_mean": float(padded["reward"].mean()),
            "learner/advantage_abs_mean": (float(adv.abs().mean()) if adv.ndim == 1 else
                                           float((adv.abs() * padded["loss_mask"]).sum() / padded["loss_mask"].sum().clamp(min=1))),
            "learner/trained_tokens": float(padded["loss_mask"].sum()),
            "learner/trajectories": float(b_all),
            "learner/compute_s": time.perf_counter() - t0,
        }
        if self.blocks:
            metrics["moe/router_frozen"] = float(self.router.frozen)
        return metrics

    def _advantages(self, padded: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B] GRPO advantages (``learner.advantage = sequence``) or [B, T-1] per-token
        group-relative reward-to-go on the training grid (``token``).

        A ``token`` learner fails on a batch without ``token_rewards`` rather than falling back
        to sequence advantages: a silent fallback would make a token-credit run a GRPO run
        without saying so (every worker shares the config, so this means a broken producer).
        """
        lc = self.cfg.learner
        if lc.advantage == "token":
            if "token_rewards" not in padded:
                raise ValueError("learner.advantage = 'token' got a batch without token_rewards; "
                                 "run the rollout workers with rollout.token_rewards = true")
            return token_group_advantages(padded["token_rewards"], padded["response_positions"], padded["group_id"],
                                          normalize_std=lc.adv_std_norm)
        return group_advantages(padded["reward"], padded["group_id"], normalize_std=lc.adv_std_norm)

    def _rank_rows(self, mb: list[int]) -> list[int]:
        sl = self.my_slice(len(mb))
        rows = mb[sl]
        return rows if rows else mb[:1]  # an idle rank joins the collectives with a dummy row

    def _train_minibatch(self, padded, adv, mb, replay, prox) -> dict[str, float]:
        lc = self.cfg.learner
        temp = self.cfg.rollout.temperature
        idle = not mb[self.my_slice(len(mb))]
        idx = self._rank_rows(mb)
        ids = padded["input_ids"][idx].to(self.device)
        attn = padded["attention_mask"][idx].to(self.device)
        mask = padded["loss_mask"][idx].to(self.device) * (0.0 if idle else 1.0)
        behav = padded["behaviour_logprobs"][idx].to(self.device)
        a = adv[idx].to(self.device) * (0.0 if idle else 1.0)
        g_mask = padded["loss_mask"][mb]
        n_tok = float(g_mask.sum().clamp(min=1)) / self.world
        n_seq = float(len(mb)) / self.world
        norm_len = float(self.cfg.rollout.max_new_tokens)
        logits, routers, values = self._forward_values(self.model, ids, attn, None if replay is None else replay[idx])
        logp = token_logprobs(logits, ids, temp)
        prox_logp = logp.detach() if prox is None else prox
        crit: dict[str, float] = {}
        if self.critic:
            resp = padded["resp"][idx].to(self.device)
            vs, a = critic_targets(values, prox_logp - behav, padded["tok_reward"][idx].to(self.device),
                                   padded["tok_done"][idx].to(self.device), resp, lc.gamma,
                                   lc.vtrace_rho_bar, lc.vtrace_c_bar)
            v_loss = value_loss(values, vs, mask, n_tok)
            crit = {"learner/value_loss": float(v_loss.detach()),
                    # global token mean after the rank average (n_tok is global / world)
                    "learner/vtrace_advantage_abs_mean": float((a.abs() * mask).sum()) / n_tok,
                    **critic_metrics(values, vs, mask, self.mesh.dp_group)}
            if lc.vtrace_adv_norm:
                a = whiten_advantages(a, mask, self.mesh.dp_group)
        pg_loss, stats = compute_policy_loss(lc, logp, prox_logp, behav, a, mask, n_tok, n_seq, norm_len)
        loss = pg_loss
        if self.critic:
            loss = loss + lc.value_coef * v_loss
        metrics = {**crit,"learner/loss": float(pg_loss.detach()), "learner/clip_frac": stats["clip_frac"],
                   "learner/is_weight_mean": stats["is_weight_mean"],
                   "learner/is_truncated_frac": stats["is_truncated_frac"]}
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logits, _ = self._forward(self.ref_model, ids, attn)
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
            tok_mask = attn.reshape(-1).float() * (0.0 if idle else 1.0)
            group = self.mesh.dp_group
            aux = load_balancing_loss(routers, self.num_experts, self.top_k, tok_mask, group, scale=self.world)
            metrics["moe/aux_loss"] = float(aux.detach()) / self.world
            if lc.aux_loss_coef > 0:
                loss = loss + lc.aux_loss_coef * aux
            if lc.z_loss_coef > 0:
                z = router_z_loss(routers, tok_mask, group, scale=self.world)
                loss = loss + lc.z_loss_coef * z
                metrics["moe/z_loss"] = float(z.detach()) / self.world
            metrics.update(router_metrics(routers, self.top_k, tok_mask, group))
            self.router.update_freeze(self.steps_done, metrics)
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.router.drop_grads()
        grad_norm = clip_grad_norm(self.model.parameters(), lc.grad_clip, self.mesh.dp_group)
        self.optim.step()
        if self.router.ema:
            self.router.update_ema()
        self.steps_done += 1
        with torch.no_grad():
            m = mask.bool()
            mismatch = float((behav - logp.detach())[m].abs().mean()) if m.any() else 0.0
        metrics["learner/behaviour_logprob_abs_diff"] = mismatch
        # Rank-local numbers (each rank saw its slice) -> the mean over ranks, same everywhere.
        # The router losses' per-rank values are shares of the global loss -> their sum.
        local = [k for k in metrics if k.startswith("learner/")]
        shares = [k for k in ("moe/aux_loss", "moe/z_loss") if k in metrics]
        if self.world > 1:
            import torch.distributed as dist

            t = torch.tensor([metrics[k] for k in local + shares], dtype=torch.float64)
            dist.all_reduce(t, group=self.mesh.dp_group)
            vals = t.tolist()
            metrics.update({k: v / self.world for k, v in zip(local, vals)})
            metrics.update(dict(zip(shares, vals[len(local):])))
        metrics["learner/grad_norm"] = grad_norm
        return metrics

    def evaluate_logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Next-token log-probs [B, T-1] in eval mode: deterministic routing, no dropout."""
        self.model.eval()
        with torch.no_grad():
            logits, _ = self._forward(self.model, ids.to(self.device), attn.to(self.device))
        self.model.train()
        return token_logprobs(logits, ids.to(self.device), self.cfg.rollout.temperature)

    def full_tensors(self) -> Iterator[torch.Tensor]:
        """Full (unsharded, all experts) parameters one at a time, in ``param_specs`` order.

        Every rank must iterate (each gather is a collective); only the consumer on rank 0
        keeps them, and only one at a time. With ``router_ema`` the routers are the EMA copies.
        """
        ema = self.router.ema_state() if self.router.ema else {}
        for name, p in self.model.named_parameters():
            if is_critic_param(name):  # the value head stays with the learner
                continue
            yield ema[name] if name in ema else full_parameter(name, p, self.mesh)

    def router_ema_state(self) -> dict[str, torch.Tensor]:
        """``{param_name: full EMA router tensor}`` for the publisher (empty when EMA is off)."""
        return self.router.ema_state() if self.router.ema else {}
