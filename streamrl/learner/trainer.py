"""The learner's model, expert parallel + FSDP2 sharding, optimizer and one policy-gradient step.

Every rank holds the full packed batch (broadcast from rank 0), computes advantages on all of it (cheap,
identical everywhere, :mod:`streamrl.learner.step_inputs`) and trains on its own slice of trajectories. A step
reads like any FSDP training loop: for each minibatch, for each of this rank's micro-batches, forward
(:meth:`Trainer._run`), the objective (:class:`~streamrl.learner.step_loss.StepLoss`), backward; clip, step.
Losses are normalised by *global* counts (tokens or sequences) divided by the world size, because
FSDP2's reduce-scatter averages over ranks; the MoE router losses all-reduce their statistics too.

With ``learner.drop_zero_advantage`` the per-sample metrics (entropy, clip and IS fractions, the
``moe/`` router metrics) cover only the trained samples (``learner/dropped_zero_adv_frac``: the rest).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.nn.attention.flex_attention import BlockMask

from streamrl.algorithms.losses import Normalizers
from streamrl.config import Config, ConfigError
from streamrl.learner.activation_checkpointing import checkpoint_decoder_layers
from streamrl.learner.attention import packed_block_mask, resolve_attention, use_packed_attention
from streamrl.learner.critic import attach_value_head, is_critic_param, value_head, vtrace_inputs
from streamrl.learner.logprobs import HeadRequest, response_head
from streamrl.learner.lora_policy import LoraPolicy
from streamrl.learner.metrics import MetricSums, host_metrics, read_minibatch_metrics
from streamrl.learner.moe_router import RouterController
from streamrl.learner.h2d import h2d_grouped
from streamrl.learner.packing import LazyMicroBatches, MicroBatch, ResponseGrid, rank_microbatches
from streamrl.learner.segment_attention import SegmentLayout, use_segment_attention
from streamrl.learner.step_inputs import (batch_advantages, batch_response_grid, batch_summary, minibatch_rows,
                                          no_signal, zero_advantage_rows)
from streamrl.learner.step_loss import ForwardOutputs, LossTargets, StepLoss
from streamrl.learner.warmup import synthetic_batch
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.models.moe import find_moe_blocks
from streamrl.parallel.expert_parallel import full_parameter, global_param_specs, parallelize, shard_policy
from streamrl.parallel.grad_clip import clip_grad_norm_on_device
from streamrl.parallel.mesh import build_mesh
from streamrl.parallel.micro_batch_gathering import MicroBatchGathering
from streamrl.roles.reference import load_reference_model, reference_role_configured, served_ref_logprobs
from streamrl.trajectory import num_trajectories
from streamrl.utils import use_tf32
from streamrl.weights.layout import ResidentTensors

Plan = tuple[LazyMicroBatches, list[float]]  # this rank's micro-batches, the global token weight of each index


def one_causal_sequence(mb: MicroBatch) -> bool:
    """True when a (host) micro-batch row is one unit with one sample: prompt then response,
    for which the packed mask is plain causal."""
    samples = mb.segment_ids[mb.segment_ids >= 0]  # -1 marks the unit's prompt
    one_sample = samples.numel() == 0 or bool(samples.min() == samples.max())
    return one_sample and bool(mb.unit_ids.min() == mb.unit_ids.max())


class Trainer:
    """Model + expert parallel + FSDP2 + AdamW; :meth:`step` trains on one packed batch."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        lc = cfg.learner
        if lc.advantage == "token" and not cfg.rollout.token_rewards:
            raise ConfigError("config field 'learner.advantage' = 'token': needs rollout.token_rewards = true "
                              "(the per-token rewards it is computed from)")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Same seed on every rank: identical initial weights before sharding. An HF folder with
        # model.load = sharded comes on the meta device; parallelize() loads each rank's shards
        # by HF name, which PEFT's wrapping renames: a LoRA run loads whole, then wraps and shards.
        lora = cfg.model.lora.active
        model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed, defer_weights=not lora)
        self.lora = LoraPolicy(model, cfg.model.lora, cfg.run.seed) if lora else None
        self.tokenizer = tok
        self.pad_id = tok.pad_token_id
        self.device = torch.device("cpu")
        if lc.device.startswith("cuda"):
            self.device = torch.device("cuda", torch.cuda.current_device())
        use_tf32(self.device)  # the fp32 matmuls that remain (fp32 model without mixed precision, the head)
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        self.vocab_size = int(model.config.vocab_size)
        hf_blocks = find_moe_blocks(model)
        self.num_experts = int(hf_blocks[0][1].experts.gate_up_proj.shape[0]) if hf_blocks else 0
        self.is_moe = bool(hf_blocks)
        # One process is FSDP-wrapped too when that gives it mixed precision (shard_policy).
        wrap_one = shard_policy(1, self.device.type, lc.mixed_precision) is not None
        self.mesh = build_mesh(lc.ep, self.device.type, self.num_experts, single_rank=wrap_one)
        self.ref_model = None  # None with kl_coef > 0: the reference role scores (ref_logprobs in the batch)
        if lc.kl_coef > 0 and not reference_role_configured(cfg) and self.lora is None:
            self.ref_model = load_reference_model(cfg, model)
            parallelize(self.ref_model, self.mesh, self.device, lc.experts_impl, lc.mixed_precision)
        # The critic's head joins the model before sharding: the root fully_shard covers it,
        # the optimizer and DCP checkpoints see it like any other parameter.
        self.critic = lc.loss == "vtrace"
        if self.critic:
            attach_value_head(model)
        self.blocks = parallelize(model, self.mesh, self.device, lc.experts_impl, lc.mixed_precision,
                                  compile_layers=lc.compile)
        if self.lora is not None:
            self.lora.freeze_base()
        self.model = model
        self.gathering = MicroBatchGathering(model, self.mesh.dims.world)
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
        self.param_specs = self.lora.specs() if self.lora else [
            s for s in global_param_specs(model, lc.ep) if not is_critic_param(s[0])]
        self.router = RouterController(model, self.blocks, lc)
        # Fused AdamW: one pass over each parameter instead of ~10 foreach passes (the foreach
        # default costs ~9 % of a 1.31 B MoE step on the H200, ~15 % of a 2 x 8 SmolLM2
        # shared-prompt step on 2 CPU cores; fused is 2-7x cheaper, memory bound).
        trained = self.lora.trainable() if self.lora else model.parameters()
        self.optim = torch.optim.AdamW(trained, lr=lc.lr, weight_decay=lc.weight_decay, betas=(0.9, 0.99),
                                       fused=True)
        self.loss_fn = StepLoss(lc, self.num_experts, self.top_k, self.world, self.mesh.dp_group)
        self.steps_done = 0
        self._resident: ResidentTensors | None = None  # full_tensors() in one process

    def step(self, batch: TensorDict) -> dict[str, float]:
        """One learner step (``minibatches`` optimizer steps) on a packed batch, same on every rank.

        Each minibatch is split over the ranks (contiguous trajectories), each rank's share is
        packed into token-budget micro-batches (:mod:`streamrl.learner.packing`) whose gradients
        accumulate before one optimizer step.
        """
        t0 = time.perf_counter()
        lc = self.cfg.learner
        grid, adv, mbs, plans = self._prepare(batch)
        base = batch_summary(batch, adv, grid, self._dropped_rows(adv, grid))
        if no_signal(lc, adv, self.critic):
            # Every group's rewards alike: no policy-gradient signal. An AdamW step here would
            # only scale the router/entropy terms' tiny gradients up to full-size moves (and let
            # its second moment decay), which tips converged tiny runs over after ~100 such
            # steps. Same batch on every rank, so every rank skips together.
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
            pending.append(self.train_minibatch(batch, grid, adv, mb, plans[j], None if prox_all is None else prox_all[j]))
            if j + 1 < len(mbs):  # the next minibatch's first micro-batch while the device steps
                plans[j + 1][0].prefetch(0)
        agg: dict[str, float] = {}
        for m in read_minibatch_metrics(pending, self.world, self.mesh.dp_group):
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
        grid = batch_response_grid(batch, self.critic)
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

    def _prepare(self, batch: TensorDict) -> tuple[ResponseGrid, torch.Tensor, list[list[int]], list[Plan]]:
        """(response grid, advantages, minibatches as trajectory lists, each one's micro-batch plan).

        The plans' micro-batches are built when the training loop first reaches them
        (:class:`~streamrl.learner.packing.LazyMicroBatches`): only the grid and the advantages
        are host work before the step's first kernel."""
        grid = batch_response_grid(batch, self.critic)
        adv = batch_advantages(self.cfg, batch, grid)
        mbs = minibatch_rows(batch, self.cfg.learner.minibatches)
        drop = self._dropped_rows(adv, grid).tolist()
        return grid, adv, mbs, [self._microbatches(batch, [i for i in mb if not drop[i]]) for mb in mbs]

    def _dropped_rows(self, adv: torch.Tensor, grid: ResponseGrid) -> torch.Tensor:
        """[N] bool: the samples left out of the forward/backward (:func:`~streamrl.learner.step_inputs.zero_advantage_rows`)."""
        return zero_advantage_rows(self.cfg.learner, adv, grid, self.critic, self.is_moe)

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
        staging buffer and one copy per dtype: :func:`~streamrl.learner.h2d.h2d_grouped`)."""
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
                        plan: Plan, prox: list[torch.Tensor] | None = None, optimizer_step: bool = True
                        ) -> MetricSums:
        """Accumulate the gradient of minibatch ``mb`` over this rank's micro-batches (``plan``),
        then (``optimizer_step``) clip and step. The gradient is that of one loss over the whole
        minibatch: every term is normalised by global counts (``learner.agg``), and the router
        losses by each micro-batch's share of the global tokens. ``prox``: the proximal
        log-probs of each micro-batch ([b, R]), None for the current weights. Returns the
        metric sums, still on the device (:func:`~streamrl.learner.metrics.read_minibatch_metrics`)."""
        micro, weights = plan
        # Counts come from the host copy of the grid: nothing below waits for the device until
        # the metrics are read, once, after the optimizer step.
        norm = Normalizers(self.cfg.learner.agg, num_tokens=float(grid.loss_mask[mb].sum().clamp(min=1)) / self.world,
                           num_seqs=float(len(mb)) / self.world, norm_len=float(self.cfg.rollout.max_new_tokens))
        total_w = max(sum(weights), 1.0)
        crit_pre = self._critic_prepass(grid, micro, grid.width, prox) if self.critic and len(micro) > 1 else None
        if optimizer_step:
            self.optim.zero_grad(set_to_none=True)
        dev_grid = self._h2d(grid.loss_mask, grid.behav, adv)
        sums = MetricSums()
        with self.gathering.minibatch():
            for i, m in enumerate(micro):
                logp, ent, values, routers = self._run(self.model, m, grid.width, entropy=self._computes_entropy(),
                                                       values=True)
                out = ForwardOutputs(logp, ent, values, routers)
                tgt = self._loss_targets(batch, grid, dev_grid, m, out, None if prox is None else prox[i],
                                         None if crit_pre is None else crit_pre[i])
                tgt.router_share, tgt.micro_batches = weights[i] / total_w, len(micro)
                loss, metrics = self.loss_fn(out, tgt, norm)
                sums.add_all(metrics)
                sums.tokens += tgt.tokens
                self.gathering.before_backward(last=i == len(micro) - 1)
                loss.backward()
                # The next micro-batch's host work (packing, pinned copies, H2D, block mask) while
                # the device runs this one's backward (queued by now on CUDA).
                micro.prefetch(i + 1)
        key = "learner/behaviour_logprob_abs_diff"
        sums.values[key] = sums.values[key] / sums.tokens if sums.tokens else 0.0
        if optimizer_step:
            self._optimizer_step(sums, bool(routers))
        return sums

    def _loss_targets(self, batch: TensorDict, grid: ResponseGrid, dev_grid: list[torch.Tensor], m: MicroBatch,
                      out: ForwardOutputs, prox: torch.Tensor | None, crit: tuple | None) -> LossTargets:
        """What micro-batch ``m``'s forward ``out`` is scored against; ``dev_grid``: the
        (loss mask, behaviour log-probs, advantages) of the batch on the device."""
        live = 0.0 if m.dummy else 1.0
        rows = m.row_slice
        loss_mask, behav_all, adv_all = dev_grid
        mask = loss_mask[rows] * live
        tgt = LossTargets(prox_logp=out.logp.detach() if prox is None else prox, behav_logp=behav_all[rows],
                          advantages=adv_all[rows] * live, mask=mask, token_weight=m.token_weight,
                          tokens=float(grid.loss_mask[m.rows].sum()) * live)
        if self.critic:
            tgt.value_targets, tgt.advantages = crit if crit is not None else vtrace_inputs(
                self.cfg.learner, grid, m.rows, out.values, tgt.prox_logp, mask, self.mesh.dp_group)
        if self.cfg.learner.kl_coef > 0:
            if self.ref_model is not None:
                with torch.no_grad():
                    tgt.ref_logp = self._run(self.ref_model, m, grid.width)[0]
            elif self.lora is not None:  # the frozen base is the reference
                with torch.no_grad(), self.lora.reference():
                    tgt.ref_logp = self._run(self.model, m, grid.width)[0]
            else:
                tgt.ref_logp = served_ref_logprobs(batch, m.rows).to(self.device)
        return tgt

    def _optimizer_step(self, sums: MetricSums, moe: bool) -> None:
        """Router freeze/unfreeze and gradient drop, clip (the norm into ``sums``), AdamW, router EMA."""
        lc = self.cfg.learner
        # The unfreeze gates read router metrics (a wait for the device): only while frozen
        # and past router_freeze_steps, before which they cannot unfreeze whatever they read.
        if moe and self.router.frozen and self.steps_done >= lc.router_freeze_steps:
            self.router.update_freeze(self.steps_done, host_metrics(sums.values))
        self.router.drop_grads()
        trained = [p for g in self.optim.param_groups for p in g["params"]]  # with LoRA: no frozen base
        sums.values["learner/grad_norm"] = clip_grad_norm_on_device(trained, lc.grad_clip,
                                                                    self.mesh.dp_group)
        self.optim.step()
        if self.router.ema:
            self.router.update_ema()
        self.steps_done += 1

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
        vs, a = vtrace_inputs(self.cfg.learner, grid, rows, values, logp, mask, self.mesh.dp_group)
        out, lo = [], 0
        for m in micro:
            out.append((vs[lo : lo + len(m.rows)], a[lo : lo + len(m.rows)]))
            lo += len(m.rows)
        return out

    def full_tensors(self) -> Iterable[torch.Tensor] | Iterable[list[torch.Tensor]]:
        """Full (unsharded, all experts) parameters in ``param_specs`` order.

        Every rank must iterate (each gather is a collective); only the consumer on rank 0
        keeps them, and only one at a time. With ``router_ema`` the routers are the EMA copies;
        with LoRA, the adapters' packed tensors, each as a list of pieces.

        In one process (no LoRA, no router EMA) every parameter is whole where it lives: the
        tensors are the parameters' own storage, which the optimizer, the gradient clip and
        checkpoint loads update in place, and the same :class:`ResidentTensors` is returned at
        every call, so the ipc publisher replays its copies of the last version instead of
        taking each tensor again (Python per tensor, not bytes, bounds a one-GPU publish).
        """
        if self.lora is not None:  # an adapter version: its packed tensors, each as a list of pieces
            return self.lora.full_tensors()
        if self.world == 1 and not self.router.ema:
            if self._resident is None:
                self._resident = ResidentTensors(self._gathered())
            return self._resident
        return self._gathered()

    def _gathered(self) -> Iterator[torch.Tensor]:
        """Each published parameter's full tensor, gathered when it is taken (a collective)."""
        ema = self.router.ema_state() if self.router.ema else {}
        for name, p in self.model.named_parameters():
            if is_critic_param(name):  # the value head stays with the learner
                continue
            yield ema[name] if name in ema else full_parameter(name, p, self.mesh)

    def checkpointed_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) a checkpoint holds: all of them, or with LoRA the trained ones only
        (the frozen base is read again from ``model.path`` on resume)."""
        return self.lora.trainable_named() if self.lora is not None else self.model.named_parameters()
