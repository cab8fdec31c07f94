"""The learner's model, FSDP2 sharding, optimizer and one policy-gradient step.

Every rank holds the full packed batch (broadcast from rank 0), computes advantages on all
of it (cheap, and identical everywhere), and trains on its own slice of trajectories.
Loss is a global token-mean: each rank divides its token sum by the global token count and
multiplies by the world size, because FSDP2's gradient reduce-scatter averages over ranks.
"""
from __future__ import annotations

import math
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict

from streamrl.algorithms.advantages import group_advantages
from streamrl.algorithms.losses import ppo_clip_tis_loss
from streamrl.config import Config
from streamrl.models.factory import load_model_and_tokenizer
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


def moe_router_stats(router_logits: tuple[torch.Tensor, ...] | None, top_k: int) -> dict[str, float]:
    """Per-layer ``moe/router_entropy`` and ``moe/expert_usage_std`` (seed article metrics).

    router_logits: per layer [N_tokens, E]. Entropy is of the routing softmax, normalised by
    log E (1 = uniform); usage std is the std of the fraction of top-k assignments per expert,
    times E (0 = perfectly balanced, 1 = std equal to the mean load).
    """
    if not router_logits:
        return {}
    out = {}
    ents, stds = [], []
    for i, logits in enumerate(router_logits):
        logits = logits.detach().float()
        e = logits.shape[-1]
        p = logits.softmax(-1)
        ent = float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean() / math.log(e))
        chosen = logits.topk(top_k, dim=-1).indices.flatten()
        usage = torch.bincount(chosen, minlength=e).float()
        usage = usage / usage.sum().clamp(min=1)
        std = float(usage.std() * e)
        out[f"moe/router_entropy/layer{i}"] = ent
        out[f"moe/expert_usage_std/layer{i}"] = std
        ents.append(ent)
        stds.append(std)
    out["moe/router_entropy"] = sum(ents) / len(ents)
    out["moe/expert_usage_std"] = sum(stds) / len(stds)
    return out


class Trainer:
    """Model + FSDP2 + AdamW; :meth:`step` trains on one packed batch."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Same seed on every rank: identical initial weights before sharding.
        model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        self.tokenizer = tok
        self.pad_id = tok.pad_token_id
        self.device = torch.device("cpu")
        if cfg.learner.device.startswith("cuda"):
            self.device = torch.device("cuda", torch.cuda.current_device())
        model.to(self.device)
        self.top_k = getattr(model.config, "num_experts_per_tok", 0)
        self.is_moe = bool(getattr(model.config, "num_experts", 0))
        # Names and global shapes before sharding: the weights manifest is built from these.
        self.param_specs = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
        if self.world > 1:
            self._shard(model)
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr,
                                       weight_decay=cfg.learner.weight_decay, betas=(0.9, 0.99))

    def _shard(self, model) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def my_slice(self, n: int) -> slice:
        """Contiguous trajectory range of this rank among ``n`` (ranks may get 0)."""
        per = math.ceil(n / self.world)
        lo = min(self.rank * per, n)
        return slice(lo, min(lo + per, n))

    def step(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step on a packed batch (identical on every rank)."""
        t0 = time.perf_counter()
        cfg = self.cfg.learner
        padded = to_padded(batch, self.pad_id)
        adv = group_advantages(padded["reward"], padded["group_id"])
        total_tokens = float(padded["loss_mask"].sum().clamp(min=1))
        sl = self.my_slice(padded["input_ids"].shape[0])
        ids = padded["input_ids"][sl].to(self.device)
        attn = padded["attention_mask"][sl].to(self.device)
        mask = padded["loss_mask"][sl].to(self.device)
        behav = padded["behaviour_logprobs"][sl].to(self.device)
        self.model.train()
        if ids.shape[0] == 0:
            # An idle rank still joins FSDP's collectives, with a zero-weight dummy sequence.
            ids = padded["input_ids"][:1].to(self.device)
            attn = padded["attention_mask"][:1].to(self.device)
            mask = torch.zeros_like(padded["loss_mask"][:1]).to(self.device)
            behav = torch.zeros_like(mask)
            adv_slice = torch.zeros(1)
        else:
            adv_slice = adv[sl]
        out = self.model(input_ids=ids, attention_mask=attn, output_router_logits=self.is_moe, use_cache=False)
        logp = token_logprobs(out.logits, ids, self.cfg.rollout.temperature)
        pg_loss, stats = ppo_clip_tis_loss(
            logp, logp.detach(), behav, adv_slice.to(self.device), mask,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            tis_cap=cfg.tis_cap if cfg.loss == "grpo_tis" else None,
            denom=total_tokens / self.world,
        )
        loss = pg_loss
        aux = getattr(out, "aux_loss", None)
        if aux is not None and cfg.aux_loss_coef > 0:
            loss = loss + cfg.aux_loss_coef * aux
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optim.step()
        with torch.no_grad():
            m = mask.bool()
            mismatch = float((behav - logp.detach())[m].abs().mean()) if m.any() else 0.0
        metrics = {
            "learner/loss": float(pg_loss.detach()) * self.world,
            "learner/grad_norm": float(grad_norm),
            "learner/reward_mean": float(padded["reward"].mean()),
            "learner/advantage_abs_mean": float(adv.abs().mean()),
            "learner/trained_tokens": total_tokens,
            "learner/trajectories": float(padded["reward"].numel()),
            "learner/clip_frac": stats["clip_frac"],
            "learner/is_weight_mean": stats["is_weight_mean"],
            "learner/is_truncated_frac": stats["is_truncated_frac"],
            "learner/behaviour_logprob_abs_diff": mismatch,
            "learner/compute_s": time.perf_counter() - t0,
        }
        if aux is not None:
            metrics["moe/aux_loss"] = float(aux.detach())
        metrics.update(moe_router_stats(getattr(out, "router_logits", None), self.top_k))
        return metrics

    def full_tensors(self) -> Iterator[torch.Tensor]:
        """Full (unsharded) parameters one at a time, in ``param_specs`` order.

        Every rank must iterate (each ``full_tensor()`` is a collective); only the consumer
        on rank 0 keeps them, and only one at a time.
        """
        for _, p in self.model.named_parameters():
            t = p.data
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield t.detach()
