"""The learner's model, expert parallel + FSDP2 sharding, optimizer and one policy-gradient step.

Every rank holds the full packed batch (broadcast from rank 0), computes advantages on all
of it (cheap, and identical everywhere), and trains on its own slice of trajectories.
Losses are normalised by *global* counts (tokens or sequences) divided by the world size,
because FSDP2's gradient reduce-scatter averages over ranks; the MoE router losses
all-reduce their statistics so their gradient is that of the global loss too.

Samples whose advantage is 0 on every loss token add exactly 0 to the loss and its gradient
when nothing else trains on them (no critic, KL, entropy bonus or MoE router loss): with
``learner.drop_zero_advantage`` they are left out of the micro-batches before the split over
ranks, while every normaliser still counts them (:meth:`Trainer.zero_advantage_rows`). The
per-sample metrics (``learner/entropy``, ``clip_frac``, ``is_weight_mean``,
``is_truncated_frac``, ``behaviour_logprob_abs_diff``, the ``moe/`` router metrics) then
cover only the trained samples; ``learner/dropped_zero_adv_frac`` says how many were left out.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator

import torch
from tensordict import TensorDict
from torch.nn.attention.flex_attention import BlockMask

from streamrl.algorithms.advantages import group_advantages, token_group_advantages
from streamrl.algorithms.moe_losses import load_balancing_loss, router_z_loss
from streamrl.config import Config, ConfigError
from streamrl.learner.critic import (attach_value_head, critic_metrics, critic_targets, is_critic_param,
                                     response_mdp, value_head, value_loss, whiten_advantages)
from streamrl.learner.attention import packed_block_mask, resolve_attention, use_packed_attention
from streamrl.learner.checkpointing import checkpoint_decoder_layers
from streamrl.learner.logprobs import HeadRequest, response_head, token_logprobs
from streamrl.learner.padded_reference import padded_routed_experts  # noqa: F401  (re-exported)
from streamrl.learner.moe_router import RouterController, router_metrics
from streamrl.learner.objective import compute_policy_loss, kl_term
from streamrl.learner.packing import (LazyMicroBatches, MicroBatch, ResponseGrid, h2d_grouped, rank_microbatches,
                                     response_grid, response_positions)
from streamrl.learner.segment_attention import SegmentLayout, use_segment_attention
from streamrl.learner.warmup import synthetic_batch
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.models.moe import find_moe_blocks
from streamrl.parallel.expert_parallel import full_parameter, global_param_specs, parallelize
from streamrl.parallel.mesh import build_mesh
from streamrl.roles.critic import served_gae_advantages
from streamrl.roles.reference import load_reference_model, reference_role_configured, served_ref_logprobs
from streamrl.trajectory import num_trajectories


def clip_grad_norm(params, max_norm: float, group=None) -> float:
    """:func:`clip_grad_norm_on_device`, the norm read back as a float (waits for the device)."""
    return float(clip_grad_norm_on_device(params, max_norm, group))


def clip_grad_norm_on_device(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip gradients to a global L2 norm; returns the norm before clipping (0-dim float64 tensor
    on the gradients' device; nothing here waits for the device).

    Works across FSDP meshes of different shapes (dense params over all ranks, experts over
    ``dp_shard``) where ``torch.nn.utils.clip_grad_norm_`` cannot mix DTensor meshes: every
    rank holds a disjoint shard of every gradient, so the squared norm is a sum over ranks.
    Like ``clip_grad_norm_(foreach=True)`` the scale ``min(1, max_norm / (norm + 1e-6))`` is
    applied on the device, to every gradient (a multiply by 1 below the limit, skipped on CPU
    where reading the norm costs nothing).
    """
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not local:
        return torch.zeros((), dtype=torch.float64)
    # fp32 (fp64) accumulation inside the kernel, no fp32 copy of bf16 gradients; squares summed in fp64
    acc = torch.float64 if any(x.dtype == torch.float64 for x in local) else torch.float32
    sq = torch.stack(torch._foreach_norm([x.detach() for x in local], 2, dtype=acc)).double().pow(2).sum()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if coef.device.type == "cpu" and float(coef) >= 1.0:  # reading a CPU value waits for nothing
        return norm
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for x in local:
        by_dtype.setdefault(x.dtype, []).append(x)
    for xs in by_dtype.values():
        torch._foreach_mul_(xs, coef.to(xs[0].dtype))
    return norm


def _host_metrics(acc: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Device scalars and floats -> floats, with a single device-to-host copy."""
    return _host_metrics_many([acc])[0]


def _host_metrics_many(accs: list[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """:func:`_host_metrics` of several dicts with ONE device-to-host copy for all of them."""
    keys = [(j, k) for j, acc in enumerate(accs) for k, v in acc.items() if isinstance(v, torch.Tensor)]
    dev = accs[keys[0][0]][keys[0][1]].device if keys else None
    vals = (torch.stack([accs[j][k].detach().to(dev, torch.float64).reshape(()) for j, k in keys]).tolist()
            if keys else [])
    out = [{k: float(v) for k, v in acc.items() if not isinstance(v, torch.Tensor)} for acc in accs]
    for (j, k), v in zip(keys, vals):
        out[j][k] = v
    return out


def one_causal_sequence(mb: MicroBatch) -> bool:
    """True when a (host) micro-batch row is one unit with one sample: prompt then response,
    for which the packed mask is plain causal."""
    samples = mb.segment_ids[mb.segment_ids >= 0]  # -1 marks the unit's prompt
    one_sample = samples.numel() == 0 or bool(samples.min() == samples.max())
    return one_sample and bool(mb.unit_ids.min() == mb.unit_ids.max())


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
        # Same seed on every rank: identical initial weights before sharding. An HF folder with
        # model.load = sharded comes on the meta device; parallelize() loads each rank's shards.
        model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed, defer_weights=True)
        self.tokenizer = tok
        self.pad_id = tok.pad_token_id
        self.device = torch.device("cpu")
        if lc.device.startswith("cuda"):
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        self.vocab_size = int(model.config.vocab_size)
        hf_blocks = find_moe_blocks(model)
        self.num_experts = int(hf_blocks[0][1].experts.gate_up_proj.shape[0]) if hf_blocks else 0
        self.is_moe = bool(hf_blocks)
        self.mesh = build_mesh(lc.ep, self.device.type, self.num_experts)
        self.ref_model = None  # None with kl_coef > 0: the reference role scores (ref_logprobs in the batch)
        if lc.kl_coef > 0 and not reference_role_configured(cfg):
            self.ref_model = load_reference_model(cfg, model)
            parallelize(self.ref_model, self.mesh, self.device, lc.experts_impl, lc.mixed_precision)
        # The critic's head joins the model before sharding: the root fully_shard covers it,
        # the optimizer and DCP checkpoints see it like any other parameter.
        self.critic = lc.loss == "vtrace"
        if self.critic:
            attach_value_head(model)
        self.blocks = parallelize(model, self.mesh, self.device, lc.experts_impl, lc.mixed_precision,
                                  compile_layers=lc.compile)
        self.model = model
        # flex: packed rows get a BlockMask (masked tiles skipped); segments: each packed row's
        # attention by segment (the CPU default); padded inputs run sdpa either way.
        self.attention = resolve_attention(lc.attention, self.device.type)
        for m in (model, self.ref_model) if self.attention in ("flex", "segments") else ():
            if m is not None:
                (use_packed_attention if self.attention == "flex" else use_segment_attention)(m)
        if lc.activation_checkpointing:
            checkpoint_decoder_layers(model)
        # Names and global shapes: the weights manifest is built from these (no value head:
        # rollout engines have no such parameter).
        self.param_specs = [s for s in global_param_specs(model, lc.ep) if not is_critic_param(s[0])]
        self.router = RouterController(model, self.blocks, lc)
        # Fused AdamW: one pass over each parameter instead of ~10 foreach passes. The foreach
        # default took ~9 % of a 1.31 B MoE step on the H200 and ~15 % (4.2 s) of a 2 x 8 SmolLM2
        # shared-prompt step on 2 CPU cores, where fused takes 0.6-2 s (memory bound, both noisy).
        self.optim = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.99),
                                       fused=True)
        self.steps_done = 0

    def my_slice(self, n: int) -> slice:
        """Contiguous trajectory range of this rank among ``n`` (ranks may get 0)."""
        per = math.ceil(n / self.world)
        lo = min(self.rank * per, n)
        return slice(lo, min(lo + per, n))

    def _forward(self, model, ids, attn, replay=None):
        """Padded forward: logits [B, T, V] and per-layer router logits [B*T, E] (replay: [B, T, L, k] or None).

        Used by :meth:`evaluate_logprobs` and the padded reference step; training uses :meth:`_run`.
        """
        for i, b in enumerate(self.blocks if model is self.model else []):
            b.replay = None if replay is None else replay[:, :, i].reshape(-1, replay.shape[-1]).to(self.device)
        try:
            out = model(input_ids=ids, attention_mask=attn, use_cache=False)
        finally:
            for b in self.blocks:
                b.replay = None
        routers = [b.last_router_logits for b in self.blocks] if model is self.model else []
        return out.logits, routers

    def step(self, batch: TensorDict) -> dict[str, float]:
        """One learner step (``minibatches`` optimizer steps) on a packed batch, same on every rank.

        Each minibatch is split over the ranks (contiguous trajectories), each rank's share is
        packed into token-budget micro-batches (:mod:`streamrl.learner.packing`) whose gradients
        accumulate before one optimizer step.
        """
        t0 = time.perf_counter()
        lc = self.cfg.learner
        grid, adv, mbs, plans = self._prepare(batch)
        n_all = num_trajectories(batch)
        mask = grid.loss_mask
        base = {
            "learner/dropped_zero_adv_frac": float(self.zero_advantage_rows(adv, grid).float().mean()),
            "learner/reward_mean": float(batch["reward"].mean()),
            "learner/advantage_abs_mean": (float(adv.abs().mean()) if adv.ndim == 1 else
                                           float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))),
            "learner/trained_tokens": float(mask.sum()),
            "learner/trajectories": float(n_all),
        }
        if self._no_signal(adv):
            # Every group's rewards alike: no policy-gradient signal. An AdamW step here would
            # only scale the router/entropy terms' tiny gradients up to full-size moves (and let
            # its second moment decay), which is what tipped converged tiny runs over after ~100
            # such steps. Same batch on every rank, so every rank skips together.
            return {**base, "learner/skipped_no_signal": 1.0, "learner/compute_s": time.perf_counter() - t0}
        self.model.train()
        # The proximal policy: the weights before this batch's first update.
        prox_all = None
        if lc.minibatches > 1 and lc.loss != "ppo_coupled":
            with torch.no_grad():
                prox_all = [[self._run(self.model, m, grid_width=grid.width)[0] for m in micro] for micro, _ in plans]
        # Every minibatch's metrics stay on the device until all optimizer steps are queued: one
        # wait for the device per step, not one per minibatch.
        pending = []
        for j, mb in enumerate(mbs):
            pending.append(self._minibatch_pass(batch, grid, adv, mb, plans[j],
                                                None if prox_all is None else prox_all[j]))
            if j + 1 < len(mbs):  # the next minibatch's first micro-batch while the device steps
                plans[j + 1][0].prefetch(0)
        agg: dict[str, float] = {}
        for m in self._read_metrics(pending):
            for k, v in m.items():
                agg[k] = agg.get(k, 0.0) + v / len(mbs)
        metrics = {**agg, **base, "learner/skipped_no_signal": 0.0, "learner/compute_s": time.perf_counter() - t0}
        if self.blocks:
            metrics["moe/router_frozen"] = float(self.router.frozen)
        return metrics

    def warm_up(self) -> None:
        """Run :meth:`step`'s forward and backward once over a synthetic step-shaped batch and drop
        the gradients (:mod:`streamrl.learner.warmup`): the policy head (with entropy where a step
        computes it), the value head of a critic, routed-expert replay; same batch on every rank.

        No loss terms, no optimizer step, no router freeze/EMA update, no step counted: the
        weights and the optimizer state are as before, and so is every later step.
        """
        batch = synthetic_batch(self.cfg, self.vocab_size, self._replay_layers(), self.top_k, self.num_experts)
        grid = self._response_grid(batch)
        micro, _ = self._microbatches(batch, list(range(num_trajectories(batch))))
        train_entropy = self.cfg.learner.entropy_coef > 0
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        for i, m in enumerate(micro):
            logp, ent, values, _ = self._run(self.model, m, grid.width, entropy=self._computes_entropy(), values=True)
            loss = logp.sum() + (ent.sum() if train_entropy else 0.0) + (values.sum() if values is not None else 0.0)
            (loss * (0.0 if m.dummy else 1.0)).backward()
            micro.prefetch(i + 1)
        self.optim.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _replay_layers(self) -> int:
        """Decoder layers whose routing a micro-batch replays (R3): all MoE layers with ``routing_replay``, else 0."""
        return len(self.blocks) if (self.cfg.learner.routing_replay and self.blocks) else 0

    def _computes_entropy(self) -> bool:
        """A step computes the token entropy: it trains it (``entropy_coef``) or reports it (small vocabularies)."""
        return self.cfg.learner.entropy_coef > 0 or self.vocab_size <= 4096

    def _no_signal(self, adv: torch.Tensor) -> bool:
        """True when ``learner.skip_no_signal`` applies and every advantage is exactly 0
        (``adv``: [N] or [N, R]). The V-trace critic and a KL penalty train without it."""
        lc = self.cfg.learner
        return bool(lc.skip_no_signal and not self.critic and lc.kl_coef == 0 and not adv.any())

    def _prepare(self, batch: TensorDict):
        """(response grid, advantages, minibatches as trajectory lists, each one's micro-batch plan).

        The plans' micro-batches are built when the training loop first reaches them
        (:class:`~streamrl.learner.packing.LazyMicroBatches`): only the grid and the advantages
        are host work before the step's first kernel."""
        grid = self._response_grid(batch)
        adv = self._advantages(batch, grid)
        n_all = num_trajectories(batch)
        per_mb = math.ceil(n_all / self.cfg.learner.minibatches)
        mbs = [list(range(j, min(j + per_mb, n_all))) for j in range(0, n_all, per_mb)]
        drop = self.zero_advantage_rows(adv, grid).tolist()
        return grid, adv, mbs, [self._microbatches(batch, [i for i in mb if not drop[i]]) for mb in mbs]

    def zero_advantage_rows(self, adv: torch.Tensor, grid: ResponseGrid) -> torch.Tensor:
        """[N] bool: the samples to leave out of the forward/backward (``learner.drop_zero_advantage``).

        A sample whose advantage is 0 on every loss token (``adv``: [N] or [N, R]) has a policy
        loss of exactly 0 and a gradient of exactly 0 (``-0 * ratio``, in every loss preset,
        ``ppo_coupled``, dual-clip and GSPO included), in every minibatch. Leaving it out changes
        no gradient because the normalisers (``n_tok``, ``n_seq`` of ``learner.agg``) are taken
        over the whole minibatch in :meth:`train_minibatch`, not over the micro-batches. All
        False where another term trains on every sample: the V-trace critic's value loss, a KL
        penalty, an entropy bonus, and an MoE's router losses (or the unfreeze gates reading
        router metrics), which count every token.
        """
        lc = self.cfg.learner
        none = torch.zeros(adv.shape[0], dtype=torch.bool)
        gated = lc.router_freeze_steps > 0 and (lc.router_unfreeze_min_entropy > 0 or lc.router_unfreeze_max_usage_std > 0)
        router_terms = self.is_moe and (lc.aux_loss_coef > 0 or lc.z_loss_coef > 0 or gated)
        if not lc.drop_zero_advantage or self.critic or lc.kl_coef > 0 or lc.entropy_coef > 0 or router_terms:
            return none
        a = adv.detach().cpu()
        a = a[:, None] if a.ndim == 1 else a
        return ~((a != 0) & (grid.loss_mask > 0)).any(dim=1)

    def gradients(self, batch: TensorDict) -> dict[str, float]:
        """The gradient of the whole batch's loss left in ``.grad`` (no optimizer step), and its
        metrics: what :meth:`step` applies with ``minibatches = 1`` (the bench and tests compare it)."""
        grid, adv, mbs, plans = self._prepare(batch)
        dropped = float(self.zero_advantage_rows(adv, grid).float().mean())
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        out: dict[str, float] = {}
        for mb, plan in zip(mbs, plans):
            out = self.train_minibatch(batch, grid, adv, mb, plan, optimizer_step=False)
        return {**out, "learner/dropped_zero_adv_frac": dropped}

    def _response_grid(self, batch: TensorDict) -> ResponseGrid:
        g = ResponseGrid(loss_mask=response_grid(batch, "response_mask"),
                         behav=response_grid(batch, "behaviour_logprobs"),
                         positions=response_positions(batch))
        if "token_rewards" in batch.keys():
            g.token_rewards = response_grid(batch, "token_rewards")
        if self.critic:  # per-token MDP of each response; group advantages are not used
            r_lens = batch["response_lens"].tolist()
            g.tok_reward, g.tok_done, g.resp = response_mdp([1] * len(r_lens), r_lens, batch["reward"], g.width)
        return g

    def _advantages(self, batch: TensorDict, grid: ResponseGrid) -> torch.Tensor:
        """[B] GRPO advantages (``learner.advantage = sequence``) or [B, R] per-token
        group-relative reward-to-go on the response grid (``token``).

        A ``token`` learner fails on a batch without ``token_rewards`` rather than falling back
        to sequence advantages: a silent fallback would make a token-credit run a GRPO run
        without saying so (every worker shares the config, so this means a broken producer).
        """
        lc = self.cfg.learner
        if lc.advantage == "gae":  # [B, R] from the critic role's values (streamrl.roles.critic)
            return served_gae_advantages(batch, self.cfg.critic, grid.loss_mask)
        if lc.advantage == "token":
            if grid.token_rewards is None:
                raise ValueError("learner.advantage = 'token' got a batch without token_rewards; "
                                 "run the rollout workers with rollout.token_rewards = true")
            return token_group_advantages(grid.token_rewards, grid.positions, batch["group_id"],
                                          normalize_std=lc.adv_std_norm)
        return group_advantages(batch["reward"], batch["group_id"], normalize_std=lc.adv_std_norm)

    def _microbatches(self, batch: TensorDict, mb: list[int]) -> tuple[list[MicroBatch], list[float]]:
        """This rank's micro-batches of minibatch ``mb`` and the global token weight of each index."""
        lc = self.cfg.learner
        per = math.ceil(len(mb) / self.world)
        rank_rows = [mb[min(r * per, len(mb)) : min((r + 1) * per, len(mb))] for r in range(self.world)]
        layers = self._replay_layers()
        # A dense model leaves each sample's last token out of the rows (its output predicts
        # nothing); an MoE keeps it for the router losses, which count every token.
        return rank_microbatches(batch, rank_rows, self.rank, lc.max_tokens_per_microbatch, lc.shared_prompt,
                                 layers, dense_mask=self.attention == "sdpa", feed_last=self.is_moe,
                                 finish=self._on_device)

    def _on_device(self, mb: MicroBatch) -> MicroBatch:
        """``mb`` on the learner's device (non-blocking copies of pinned memory; the step moves
        each micro-batch while the device still runs the previous one) with its FlexAttention
        ``BlockMask`` when ``attention`` is flex.
        A dense sdpa mask stays on the host until its forward (``[N, N]`` each)."""
        has_row_mask = isinstance(mb.attention_mask, (BlockMask, SegmentLayout))  # built on the device
        if mb.input_ids.device == self.device and (self.attention == "sdpa" or has_row_mask):
            return mb
        moved = dataclasses.replace(mb, attention_mask=None).to(self.device)
        if self.attention == "segments":
            return dataclasses.replace(moved, attention_mask=SegmentLayout.from_ids(mb.segment_ids, mb.unit_ids
                                                                                    ).to(self.device))
        if self.attention == "flex" and not one_causal_sequence(mb):
            return dataclasses.replace(moved, attention_mask=packed_block_mask(moved.segment_ids, moved.unit_ids))
        if self.attention == "flex":
            # A row that is one plain sequence needs only the causal mask: sdpa's causal kernel.
            # Measured on the H200 (1.31 B MoE, one 32k sequence per step): flex 40.0k tok/s,
            # sdpa 51.9k (16k: 54.4k vs 60.9k).
            return moved
        return dataclasses.replace(moved, attention_mask=mb.attention_mask)

    def _h2d(self, *ts: torch.Tensor) -> list[torch.Tensor]:
        """Host tensors on the learner's device without blocking the host (on CUDA one pinned
        staging buffer and one copy per dtype: :func:`~streamrl.learner.packing.h2d_grouped`)."""
        if self.device.type == "cpu":
            return list(ts)
        moved = h2d_grouped({str(i): t for i, t in enumerate(ts)}, self.device)
        return [moved[str(i)] for i in range(len(ts))]

    def _run(self, model, mb: MicroBatch, grid_width: int, entropy: bool = False, values: bool = False):
        """Forward one micro-batch; returns response-grid tensors ``[b, R]``
        (logp, entropy or None, values or None) and the router logits per layer ``[N, E]``."""
        lc = self.cfg.learner
        mb = self._on_device(mb)
        policy = model is self.model
        values = values and self.critic and policy
        req = HeadRequest(mb.targets, self.cfg.rollout.temperature, lc.logprob_chunk_tokens,
                          entropy, value_head(model) if values else None, compiled=lc.compile)
        for i, b in enumerate(self.blocks if policy else []):
            b.replay = None if mb.replay is None else mb.replay[:, i]
        mask = mb.attention_mask
        layout = {"segment_layout": mask} if isinstance(mask, SegmentLayout) else {}
        if layout:
            mask = None  # transformers' own mask of the row is built but not read
        try:
            with response_head(model, req):
                out = model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                            attention_mask=mask.to(self.device) if isinstance(mask, torch.Tensor) else mask,
                            use_cache=False, logits_to_keep=mb.select, **layout)
        finally:
            for b in self.blocks:
                b.replay = None
        res = out.logits[0]  # [n, 3]: logp, entropy, value per selected position
        routers = [b.last_router_logits for b in self.blocks] if policy else []
        return (mb.to_grid(res[:, 0], grid_width), mb.to_grid(res[:, 1], grid_width) if entropy else None,
                mb.to_grid(res[:, 2], grid_width) if values else None, routers)

    def train_minibatch(self, batch: TensorDict, grid: ResponseGrid, adv: torch.Tensor, mb: list[int],
                        plan: tuple[LazyMicroBatches, list[float]], prox: list[torch.Tensor] | None = None,
                        optimizer_step: bool = True) -> dict[str, float]:
        """Accumulate the gradient of minibatch ``mb`` over this rank's micro-batches, then
        (``optimizer_step``) clip and step. The gradient is that of one loss over the whole
        minibatch: every term is normalised by global counts (``learner.agg``), and the router
        losses by each micro-batch's share of the global tokens. Returns its metrics (read from
        the device once, after the optimizer step is queued).
        """
        return self._read_metrics([self._minibatch_pass(batch, grid, adv, mb, plan, prox, optimizer_step)])[0]

    def _minibatch_pass(self, batch: TensorDict, grid: ResponseGrid, adv: torch.Tensor, mb: list[int],
                        plan: tuple[LazyMicroBatches, list[float]], prox: list[torch.Tensor] | None = None,
                        optimizer_step: bool = True) -> tuple[dict[str, torch.Tensor | float], float]:
        """:meth:`train_minibatch` up to its metrics, which stay on the device:
        (device scalars or floats summed over micro-batches, response tokens seen)."""
        lc = self.cfg.learner
        micro, weights = plan
        width = grid.width
        # Counts come from the host copy of the grid: nothing below waits for the device until
        # the metrics are read, once, after the optimizer step.
        n_tok = float(grid.loss_mask[mb].sum().clamp(min=1)) / self.world
        n_seq = float(len(mb)) / self.world
        norm_len = float(self.cfg.rollout.max_new_tokens)
        total_w = max(sum(weights), 1.0)
        want_ent = self._computes_entropy()
        crit_pre = self._critic_prepass(grid, micro, width, prox) if self.critic and len(micro) > 1 else None
        if optimizer_step:
            self.optim.zero_grad(set_to_none=True)
        loss_mask, behav_all, adv_all = self._h2d(grid.loss_mask, grid.behav, adv)
        acc: dict[str, torch.Tensor | float] = {}  # device scalars (or host floats) summed over micro-batches
        tok_sum = 0.0
        diff_sum = torch.zeros((), device=self.device)

        def add(k: str, v: torch.Tensor | float) -> None:
            acc[k] = acc.get(k, 0.0) + v

        for i, m in enumerate(micro):
            live = 0.0 if m.dummy else 1.0
            rows = m.row_slice
            logp, ent, values, routers = self._run(self.model, m, width, entropy=want_ent, values=True)
            mask = loss_mask[rows] * live
            behav = behav_all[rows]
            a = adv_all[rows] * live
            prox_logp = logp.detach() if prox is None else prox[i]
            loss = torch.zeros((), device=self.device)
            if self.critic:
                vs, a = crit_pre[i] if crit_pre is not None else self._critic_targets(grid, m.rows, values, prox_logp, mask)
                v_loss = value_loss(values, vs, mask, n_tok)
                loss = loss + lc.value_coef * v_loss
                add("learner/value_loss", v_loss.detach())
                add("learner/vtrace_advantage_abs_mean", (a.abs() * mask).sum().detach() / n_tok)
                for k, v in critic_metrics(values, vs, mask, self.mesh.dp_group).items():
                    add(k, v / len(micro))
            pg_loss, stats = compute_policy_loss(lc, logp, prox_logp, behav, a, mask, n_tok, n_seq, norm_len,
                                                tensor_stats=True)
            loss = loss + pg_loss
            n_m = float(grid.loss_mask[m.rows].sum()) * live
            add("learner/loss", pg_loss.detach())
            for k in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
                add(f"learner/{k}", stats[k] * n_m)
            if lc.kl_coef > 0:
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_logp = self._run(self.ref_model, m, width)[0]
                else:
                    ref_logp = served_ref_logprobs(batch, m.rows).to(self.device)
                kl = kl_term(lc, logp, ref_logp, mask, n_tok, n_seq, norm_len)
                loss = loss + lc.kl_coef * kl
                add("learner/kl_ref", kl.detach())
            if want_ent:
                ent_term = (ent * mask).sum() / n_tok
                if lc.entropy_coef > 0:
                    loss = loss - lc.entropy_coef * ent_term
                add("learner/entropy", ent_term.detach())
            if routers:
                share = weights[i] / total_w
                tok_w = m.token_weight
                group = self.mesh.dp_group
                aux = load_balancing_loss(routers, self.num_experts, self.top_k, tok_w, group, scale=self.world)
                add("moe/aux_loss", aux.detach() * share / self.world)
                if lc.aux_loss_coef > 0:
                    loss = loss + lc.aux_loss_coef * share * aux
                if lc.z_loss_coef > 0:
                    z = router_z_loss(routers, tok_w, group, scale=self.world)
                    loss = loss + lc.z_loss_coef * share * z
                    add("moe/z_loss", z.detach() * share / self.world)
                for k, v in router_metrics(routers, self.top_k, tok_w, group, as_tensors=True).items():
                    add(k, v * share)
            with torch.no_grad():
                tok_sum += n_m
                diff_sum += ((behav - logp.detach()).abs() * mask).sum()
            loss.backward()
            # The next micro-batch's host work (packing, pinned copies, H2D, block mask) while
            # the device runs this one's backward (queued by now on CUDA).
            micro.prefetch(i + 1)
        acc["learner/behaviour_logprob_abs_diff"] = diff_sum / tok_sum if tok_sum else 0.0
        if optimizer_step:
            # The unfreeze gates read router metrics (a wait for the device): only while frozen
            # and past router_freeze_steps, before which they cannot unfreeze whatever they read.
            if routers and self.router.frozen and self.steps_done >= lc.router_freeze_steps:
                self.router.update_freeze(self.steps_done, _host_metrics(acc))
            self.router.drop_grads()
            acc["learner/grad_norm"] = clip_grad_norm_on_device(self.model.parameters(), lc.grad_clip,
                                                                self.mesh.dp_group)
            self.optim.step()
            if self.router.ema:
                self.router.update_ema()
            self.steps_done += 1
        return acc, tok_sum

    def _read_metrics(self, pending: list[tuple[dict[str, torch.Tensor | float], float]]) -> list[dict[str, float]]:
        """The metrics of :meth:`_minibatch_pass` results as floats: one wait for the device for all."""
        out = []
        for metrics, (_, tok_sum) in zip(_host_metrics_many([acc for acc, _ in pending]), pending):
            for k in ("clip_frac", "is_weight_mean", "is_truncated_frac"):
                metrics[f"learner/{k}"] = (metrics[f"learner/{k}"] / tok_sum if tok_sum else
                                           (1.0 if k == "is_weight_mean" else 0.0))
            out.append(self._reduce_metrics(metrics))
        return out

    def _critic_targets(self, grid: ResponseGrid, rows: list[int], values, prox_logp, mask):
        """(V-trace targets [b, R], per-token policy advantages [b, R]) of trajectories ``rows``."""
        lc = self.cfg.learner
        behav = grid.behav[rows].to(self.device)
        vs, a = critic_targets(values, prox_logp - behav, grid.tok_reward[rows].to(self.device),
                               grid.tok_done[rows].to(self.device), grid.resp[rows].to(self.device),
                               lc.gamma, lc.vtrace_rho_bar, lc.vtrace_c_bar)
        if lc.vtrace_adv_norm:
            a = whiten_advantages(a, mask, self.mesh.dp_group)
        return vs, a

    def _critic_prepass(self, grid: ResponseGrid, micro: list[MicroBatch], width: int,
                        prox: list[torch.Tensor] | None):
        """V-trace targets and advantages of every micro-batch before any backward.

        Why a pass of its own: advantage whitening needs the statistics of the whole minibatch,
        and the targets depend on the values; without gradient this costs one forward.
        """
        with torch.no_grad():
            outs = [self._run(self.model, m, width, values=True) for m in micro]
        rows = [r for m in micro for r in m.rows]
        live = torch.cat([torch.full((len(m.rows), 1), 0.0 if m.dummy else 1.0) for m in micro])
        values = torch.cat([o[2] for o in outs])
        logp = torch.cat([o[0] for o in outs] if prox is None else prox)
        mask = (grid.loss_mask[rows] * live).to(self.device)
        vs, a = self._critic_targets(grid, rows, values, logp, mask)
        out, lo = [], 0
        for m in micro:
            out.append((vs[lo : lo + len(m.rows)], a[lo : lo + len(m.rows)]))
            lo += len(m.rows)
        return out

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Rank-local numbers (each rank saw its slice) -> the mean over ranks, same everywhere.
        The router losses' per-rank values are shares of the global loss -> their sum."""
        local = [k for k in metrics if k.startswith("learner/") and k != "learner/grad_norm"]
        shares = [k for k in ("moe/aux_loss", "moe/z_loss") if k in metrics]
        if self.world > 1:
            import torch.distributed as dist

            t = torch.tensor([metrics[k] for k in local + shares], dtype=torch.float64)
            dist.all_reduce(t, group=self.mesh.dp_group)
            vals = t.tolist()
            metrics.update({k: v / self.world for k, v in zip(local, vals)})
            metrics.update(dict(zip(shares, vals[len(local):])))
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
