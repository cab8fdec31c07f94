"""Fast path of the transformers engine: static KV cache, fixed-shape decode, CUDA graphs.

``model.generate()`` spends almost all of a decode step in Python and kernel launches (about
80 ms per step for a 24-layer MoE on an H200 that needs < 1 ms of memory traffic), grows its
KV cache every step, and keeps finished rows in the batch. This engine keeps HF's modules
(embeddings, rotary, decoder layers with their MoE experts, norm, head) but drives them
with its own loop:

* **Static KV cache** ``[B, Hkv, S, D]`` per layer, preallocated once. Each batch row (slot)
  has its own position, so rows of different lengths decode together; a row's keys are
  written at its position and the attention mask ``s <= pos[b]`` hides everything else,
  including what an earlier sequence left in the slot. That is why a slot can be reused
  without clearing, and why no KV survives a :meth:`generate` call (each call prefills its
  prompts), so a weight update can never meet stale KV.
* **Paged KV** (``kv_cache="paged"``, :mod:`streamrl.engines.paged_kv`): a block pool used as
  sequences grow instead of the static slots; a group's full prompt blocks are shared, the
  pool's size is a budget (a sequence that finds it empty is preempted and recomputed later).
* **Fixed-shape decode step** over all ``B`` slots (idle/finished slots compute and are
  ignored), captured in a CUDA graph: once per attended-span bucket with sdpa, once in all with
  FlexAttention (``decode_attention``, the CUDA default: each row reads its own blocks). Before capture the
  decoder layer is compiled once for all layers (and the step's tail once): the cache hands each layer its
  buffers, so no graph depends on a layer's index. The graph reads the
  parameters by address, so :meth:`load_weights` copies into the same storage and the next
  replay uses the new weights without a re-capture.
* **Continuous refill**: every ``sync_every`` steps the host reads the ``done`` flags (the only
  host sync of the loop: host-to-device copies go through pinned memory, :mod:`.host_io`),
  harvests finished slots and prefills new prompts into them.
* **Shared prompts**: a refill runs each distinct prompt through the model once and copies its
  K/V rows into the slots of the other samples of its group (``share_prompts``).
* **Streaming**: :meth:`generate_stream` asks a callback for new prompts whenever slots are free
  and hands each finished row over at once, so a long-tailed workload keeps every slot busy
  instead of waiting for a batch's longest sample (:meth:`generate` is its fixed-list case).
* **Per-request caps and stop strings**: ``generate(..., max_tokens=[...], stop=[...])``; caps
  live on the device per slot, stop strings are searched on the host at each sync (only the
  tokens decoded since the last one), and a cut row's slot is refilled like an EOS row's.
* **Sampling on the device**: temperature (a device scalar, so no re-capture per call),
  top-k/top-p, Gumbel-max draw (``probs / Exp(1)`` argmax, capturable) and the log-prob of
  the drawn token under the distribution actually sampled from.
* **Routing recording** by a router forward hook that scatters the top-k ids into a
  preallocated ``[B, S, L, k]`` buffer at each row's position (device ops only, so it is
  captured with the step).
* **Fused projections** on CUDA (:mod:`streamrl.engines.fused_projections`): q/k/v as one GEMM, a
  dense MLP's gate/up as one, over the parameters stacked in place at construction (a GPU decode
  step's time follows its kernel count; a CPU one's its FLOPs, where fusing measured no faster).
* MoE experts on CUDA (bf16/fp16): a decode step runs every expert on every row, weighted by the routing
  (:mod:`streamrl.engines.dense_experts`: two GEMMs, the down projections' over ``down_proj``
  laid out expert-minor in place at construction, instead of the sort/gather/scatter bookkeeping
  of HF's ``grouped_mm``, which still serves the prefills).
* **In-flight updates**: ``generate(..., between_steps=cb)`` calls ``cb`` before the first
  prefill and before every decode step; an update it returns is copied into the parameters in
  place (graphs stay valid) and stamps every later token; KV already in the cache is kept.
* **Kept sessions** (multi-turn): ``generate(..., sessions=[...])`` keeps each finished
  sequence's K/V under its session id, so the next turn of the episode prefills only its new
  tokens; LRU eviction when slots or blocks run short (see :mod:`streamrl.engines.kv_sessions`).

On CPU the same loop runs eagerly; greedy decoding gives the same tokens as ``generate()``.
The attention kernel, the cache and the sampler live in :mod:`streamrl.engines.static_kv`; the
loop of one ``generate`` call (queue, refills, harvests, preemptions, versions; O(1) Python per
decode step, no host sync between ``done`` reads) in :mod:`streamrl.engines.decode_loop`.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterable

import torch

from streamrl.engines.adapter_merge import EngineWeights
from streamrl.engines.base import BetweenSteps, Generation, teacher_forced_logprobs
from streamrl.engines.decode_loop import DecodeLoop, OnFinished
from streamrl.engines.dense_experts import DENSE, lay_out_for_dense_decode
from streamrl.engines.fused_projections import fuse_projections
from streamrl.engines.hf_fast_config import FLEX_MIN_LEN, FastHFConfig
from streamrl.engines.host_io import to_device
from streamrl.engines.kv_sessions import KeptSessions
from streamrl.engines.paged_kv import PagedKVCache
from streamrl.engines.static_kv import ATTN, StaticKVCache, sample_tokens


def _routers(model) -> list[torch.nn.Module]:
    """MoE routers in layer order (transformers 5 top-k routers return ``(logits, weights, ids)``)."""
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]


class FastHFEngine:
    """Drop-in for :class:`streamrl.engines.hf.HFEngine` with a static-cache, graph-captured decode.

    model: a transformers causal LM with ``model.model.{embed_tokens, rotary_emb, layers, norm}``
    and ``lm_head`` (Llama/Qwen/Mixtral/Qwen-MoE layouts); tokenizer: optional, for its EOS and pad
    ids and for stop strings; config: how it decodes (:class:`~streamrl.engines.hf_fast_config.FastHFConfig`);
    lora_base: ``W0`` of adapted projections in the learner's dtype when ``model`` is a cast copy
    (:func:`~streamrl.engines.precision.cast_for_engine`). The engine computes in ``model``'s dtype
    (KV cache included); log-probs are float32 either way.

    Slot state on the device, read and written in place by the captured step and by
    :class:`~streamrl.engines.decode_loop.DecodeLoop`: ``tok``/``pos``/``gen`` ``[B]`` long (last drawn
    token, its position, tokens drawn), ``done`` ``[B]`` bool, ``max_new`` ``[B]`` long (each slot's
    response cap), ``out_tok``/``out_lp`` ``[B, S+1]`` (drawn tokens and their log-probs; column ``S``
    takes idle rows' writes), ``route_hist`` ``[B, S, L, k]`` int16 or None (routing recording).
    The decode loop drives the engine through :meth:`prefill`, :meth:`extend`, :meth:`attended_span`
    and :meth:`decode_step`.
    """

    name = "hf"

    def __init__(self, model, tokenizer=None, config: FastHFConfig = FastHFConfig(),
                 lora_base: dict[str, torch.Tensor] | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.max_len = config.max_seq_len or min(getattr(model.config, "max_position_embeddings", 4096), 4096)
        self.decode_attention = config.decode_attention
        if self.decode_attention == "auto":
            self.decode_attention = "flex" if (self.device.type == "cuda" and config.kv_cache == "static"
                                               and self.max_len >= FLEX_MIN_LEN) else "sdpa"
        self.model = model.to(self.device).eval()
        mc = model.config
        self.eos_id = config.eos_token_id
        if self.eos_id is None:
            self.eos_id = getattr(tokenizer, "eos_token_id", None)
        if self.eos_id is None:
            self.eos_id = mc.eos_token_id if isinstance(mc.eos_token_id, int) else -1
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.tokenizer = tokenizer  # decodes responses for stop strings
        base = model.model
        self.embed, self.rotary, self.layers, self.norm = base.embed_tokens, base.rotary_emb, base.layers, base.norm
        self.lm_head = model.lm_head
        self.batch, self.top_k, self.top_p = config.batch_size, config.top_k, config.top_p
        self.share_prompts = config.share_prompts
        self.prefill_tokens = 0  # prompt tokens run through the model (shared prompts count once)
        self.reused_tokens = 0   # prompt tokens whose K/V a kept session supplied (not run again)
        self.span_bucket, self.sync_every = config.span_bucket, config.sync_every
        self.graphs_on = (self.device.type == "cuda") if config.cuda_graphs is None else config.cuda_graphs
        self.compile = self.graphs_on if config.compile is None else config.compile
        # torch.compile'd pieces of the decode step (_compile_decode): the decoder layer, one graph for
        # every layer, and the step's tail; the embedding and the mask between them run as they are
        self._compiled = False
        self._compiled_layers: list = []
        self._finish_fn = self._finish
        dtype = next(model.parameters()).dtype
        self.experts_impl = config.experts_implementation
        if self.experts_impl == "auto":
            self.experts_impl = "batched_mm" if (self.device.type == "cuda" and dtype == torch.float32) else DENSE
        if self.experts_impl == DENSE:
            lay_out_for_dense_decode(self.model)  # one GEMM for all down projections (values unchanged)
        if self.device.type == "cuda":  # one GEMM for q/k/v and one for gate/up (values unchanged)
            fuse_projections(self.model)
        self._params = dict(model.named_parameters())
        self._weights = EngineWeights(self._params, lora_base)
        self._build_cache(mc, dtype)
        self.preemptions = 0  # paged: sequences restarted because the pool ran out
        self.decode_steps = 0  # decode steps taken (all generate calls)
        self.sync_wait_s = 0.0  # host seconds spent waiting for the device at the loop's syncs
        self.sessions = KeptSessions(self.cache, slot_bound=not self.paged)
        self._slot_state()
        self._routing(model, config.record_routing)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.captures = 0
        self._pool = None

    def _build_cache(self, mc, dtype: torch.dtype) -> None:
        """The static slots or the paged block pool, ``S = max_len`` positions per sequence."""
        cfg = self.config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.paged = cfg.kv_cache == "paged"
        # the decode step attends the whole cache through a FlexAttention block mask, all B rows at once
        self.flex_decode = cfg.paged_attention == "flex" if self.paged else self.decode_attention == "flex"
        shape = (len(self.layers), self.batch, mc.num_key_value_heads, self.max_len, head_dim, dtype, self.device)
        if self.paged:
            self.cache = PagedKVCache(*shape, block_size=cfg.block_size, num_blocks=cfg.kv_blocks,
                                      attention=cfg.paged_attention)
        else:
            self.cache = StaticKVCache(*shape, flex=self.flex_decode)

    def _slot_state(self) -> None:
        """The persistent device buffers of the slots (see the class docstring)."""
        dev, b, s = self.device, self.batch, self.max_len
        self.tok = torch.zeros(b, dtype=torch.long, device=dev)      # last drawn token (fed next)
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)      # its position
        self.gen = torch.zeros(b, dtype=torch.long, device=dev)      # tokens drawn so far
        self.done = torch.ones(b, dtype=torch.bool, device=dev)
        self.temp = torch.ones(1, dtype=torch.float32, device=dev)
        # CPU: the sampler's log-probs and noise [2, B, V] reused across steps, its draw in place in the logits
        # (no fresh 12 MB temporaries and their page faults per SmolLM2 step; same tokens). Not on
        # CUDA: the captured graphs keep their own memory pool.
        self.noise = (torch.empty(2, b, self.lm_head.weight.shape[0], dtype=torch.float32, device=dev)
                      if dev.type == "cpu" else None)
        self.max_new = torch.ones(b, dtype=torch.long, device=dev)   # response cap of each slot
        self.out_tok = torch.zeros(b, s + 1, dtype=torch.long, device=dev)  # column s: trash for idle rows
        self.out_lp = torch.zeros(b, s + 1, dtype=torch.float32, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.positions = torch.arange(self.cache.max_span, device=dev)

    def _routing(self, model, record: bool) -> None:
        """Routing recording: a ``[B, S, L, k]`` buffer and one forward hook on every router."""
        self.routers = _routers(model) if record else []
        self.route_hist = None
        if self.routers:
            k = self.routers[0].top_k
            self.route_hist = torch.zeros(self.batch, self.max_len, len(self.routers), k, dtype=torch.int16,
                                          device=self.device)
        # one hook for every router (a per-layer closure would make a compiled layer one graph per layer)
        self._hooks = [r.register_forward_hook(self._record_route) for r in self.routers]
        self._route_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, positions) of the tokens
        self._route_dst: torch.Tensor | None = None  # route_hist[:, :, layer] of the layer running

    @property
    def compiled(self) -> bool:
        """Whether decode steps run through ``torch.compile`` now (False after a failed compilation)."""
        return self._compiled

    # ----------------------------------------------------------------------------- internals
    def _record_route(self, module, args, output) -> None:
        """Router forward hook: the top-k ids ``output[2]`` into the running layer's routing buffer."""
        if self._route_at is not None:
            rows, positions = self._route_at
            self._route_dst[rows, positions] = output[2].to(torch.int16)

    @contextlib.contextmanager
    def _impl(self):
        """Switch the model to the static-cache attention (and grouped experts) inside the engine only."""
        cfg = self.model.config
        old_attn, old_exp = cfg._attn_implementation, getattr(cfg, "_experts_implementation", None)
        cfg._attn_implementation = ATTN
        if self.experts_impl is not None and old_exp is not None:
            cfg._experts_implementation = self.experts_impl
        try:
            yield
        finally:
            cfg._attn_implementation = old_attn
            if self.experts_impl is not None and old_exp is not None:
                cfg._experts_implementation = old_exp

    def _layers(self, x, mask, pos_ids):
        """The decoder layers; a decode step of a compiled engine runs the compiled layer. Each layer's
        K/V and routing buffers are handed over here, outside the layer, so the compiled layer never
        reads its own index and one graph serves them all (dynamo would specialise on the index)."""
        cos_sin = self.rotary(x, pos_ids)
        compiled = self._compiled and not self.cache.prefill
        for i, layer in enumerate(self._compiled_layers if compiled else self.layers):
            self.cache.at_layer(i)
            if self.route_hist is not None:
                self._route_dst = self.route_hist[:, :, i]
            x = layer(x, attention_mask=mask, position_ids=pos_ids, past_key_values=self.cache,
                      position_embeddings=cos_sin, use_cache=True)
            x = x[0] if isinstance(x, tuple) else x
        return x

    def prefill(self, slots: list[int], prompts: list[list[int]], greedy: bool) -> None:
        """Prompts into ``slots`` (one slot per prompt, ``len(slots) == len(prompts)``): K/V at positions
        ``0..P_i-1``, first response token drawn into ``out_tok[slot, 0]`` (eager, variable shape
        ``[n, max P_i]``). The caller has set ``max_new[slots]`` and, for a paged cache, checked the
        pool holds the prompts' blocks.

        With ``share_prompts``, identical prompts (a GRPO group repeats one prompt G times) are
        run through the model once, in the first of their slots, and the other slots get a copy
        of its K/V (and routing) rows: the group forks from one prefill. Every slot still draws
        its own first token from the shared last-position logits.
        """
        leader: dict[tuple[int, ...], int] = {}
        src = [leader.setdefault(tuple(q), len(leader)) if self.share_prompts else i for i, q in enumerate(prompts)]
        if self.share_prompts:
            unique = [list(q) for q in leader]
            lead_slots = [slots[src.index(u)] for u in range(len(unique))]
        else:
            unique, lead_slots = prompts, slots
        n, p = len(unique), max(len(q) for q in unique)
        ids = torch.full((n, p), self.pad_id, dtype=torch.long)
        for i, q in enumerate(unique):  # right padding: each row starts at position 0
            ids[i, : len(q)] = torch.tensor(q)
        ids = to_device(ids, self.device)
        lens = to_device([len(q) for q in unique], self.device)
        rows = to_device(lead_slots, self.device)
        pos_ids = self.positions[:p].expand(n, p)
        causal = torch.ones(p, p, dtype=torch.bool, device=self.device).tril()[None, None]
        short = self.cache.grow(lead_slots, [len(q) for q in unique])
        assert not short, "KV pool exhausted inside an admitted prefill"
        self.cache.prefill, self.cache.rows = True, rows
        if self.routers:
            self._route_at = (rows.repeat_interleave(p), self.positions[:p].repeat(n))
        try:
            x = self._layers(self.embed(ids), causal, pos_ids)
        finally:
            self.cache.prefill, self._route_at = False, None
        self.prefill_tokens += int(sum(len(q) for q in unique))
        logits = self.lm_head(self.norm(x[torch.arange(n, device=self.device), lens - 1])).float()  # [n, V]
        all_rows = to_device(slots, self.device)
        if len(unique) < len(prompts):
            pick = to_device(src, self.device)
            leads = set(lead_slots)
            forks = [i for i, s in enumerate(slots) if s not in leads]
            from_slots, to_slots = [lead_slots[src[i]] for i in forks], [slots[i] for i in forks]
            self.cache.fork(from_slots, to_slots, [len(prompts[i]) for i in forks])
            if self.route_hist is not None:
                self.route_hist[to_device(to_slots, self.device), :p] = \
                    self.route_hist[to_device(from_slots, self.device), :p]
            logits, lens = logits[pick], lens[pick]
        self._first_tokens(all_rows, logits, lens, greedy)

    def extend(self, slots: list[int], prompts: list[list[int]], starts: list[int], greedy: bool) -> None:
        """Prompts of kept sessions into their ``slots``, whose positions ``0..starts[i]-1`` already
        hold the prompt's K/V (attached by the caller): only ``prompts[i][starts[i]:]`` runs
        (``[n, max(P_i - start_i)]`` queries), attending the kept positions; first token drawn as
        in :meth:`prefill`."""
        n, q = len(slots), max(len(p) - st for p, st in zip(prompts, starts))
        ids = torch.full((n, q), self.pad_id, dtype=torch.long)
        for i, (p, st) in enumerate(zip(prompts, starts)):
            ids[i, : len(p) - st] = torch.tensor(p[st:])
        dev = self.device
        ids = to_device(ids, dev)
        start = to_device(starts, dev)
        lens = to_device([len(p) for p in prompts], dev)
        rows = to_device(slots, dev)
        # padding queries sit past their row's prompt (clamped into the cache); their output is unused
        pos_ids = (start[:, None] + torch.arange(q, device=dev)).clamp_(max=self.cache.max_span - 1)  # [n, q]
        quantum = self.cache.span_quantum
        span = min(-(-max(len(p) for p in prompts) // quantum) * quantum, self.cache.max_span)
        mask = (torch.arange(span, device=dev)[None, None, :] <= pos_ids[:, :, None])[:, None]  # [n, 1, q, span]
        short = self.cache.grow(slots, [len(p) for p in prompts])
        assert not short, "KV pool exhausted inside an admitted prefill"
        self.cache.prefill, self.cache.rows, self.cache.start, self.cache.span = True, rows, start, span
        try:
            x = self._layers(self.embed(ids), mask, pos_ids)
        finally:
            self.cache.prefill, self.cache.start = False, None
        self.prefill_tokens += int(sum(len(p) - st for p, st in zip(prompts, starts)))
        self.reused_tokens += int(sum(starts))
        logits = self.lm_head(self.norm(x[torch.arange(n, device=dev), lens - start - 1])).float()  # [n, V]
        self._first_tokens(rows, logits, lens, greedy)

    def _first_tokens(self, rows: torch.Tensor, logits: torch.Tensor, lens: torch.Tensor, greedy: bool) -> None:
        """Draw each slot's first response token from its prompt's last logits ``[n, V]``."""
        tok, lp = sample_tokens(logits, None if greedy else self.temp, self.top_k, self.top_p, self.noise)
        self.out_tok[rows, 0], self.out_lp[rows, 0] = tok, lp
        self.tok[rows], self.pos[rows] = tok, lens
        self.gen[rows] = 1
        self.done[rows] = (tok == self.eos_id) | (self.max_new[rows] <= 1)

    def _decode(self, span: int, greedy: bool, rows: torch.Tensor | None = None) -> None:
        """One step for all ``B`` slots (device ops on persistent buffers only: captured as is), or,
        eager, for the live slots ``rows`` ``[n]`` only (:meth:`_live_rows`)."""
        full = rows is None
        rows = self.rows if full else rows
        if self.flex_decode:  # the block mask bounds each row: the whole cache is the span
            span = self.cache.max_span
        pos = self.pos if full else self.pos[rows]
        self.cache.rows, self.cache.pos, self.cache.span = rows, pos, span
        if self.routers:
            self._route_at = (rows, pos)
        pos_ids = pos[:, None]
        x = self.embed((self.tok if full else self.tok[rows])[:, None])
        if self.flex_decode:  # each row's own blocks of the whole cache (the paged pool in place)
            mask = self.cache.decode_block_mask(self.pos)
        else:
            # Additive mask built once per step (a bool mask is converted again in every layer).
            allowed = (self.positions[:span][None, :] <= pos_ids)[:, None, None, :]  # [n, 1, 1, span]
            mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed, float("-inf"))
        x = self._layers(x, mask, pos_ids)
        self._route_at = None
        self._finish_fn(x[:, -1], greedy, None if full else rows)

    def _finish(self, hidden: torch.Tensor, greedy: bool, rows: torch.Tensor | None) -> None:
        """The decode step's tail: head, draw and bookkeeping of every slot (``rows`` None) or of the live
        ``rows [n]``; ``hidden [B|n, H]`` is the last layer's output."""
        logits = self.lm_head(self.norm(hidden)).float()
        tok, lp = sample_tokens(logits, None if greedy else self.temp, self.top_k, self.top_p, self.noise)
        if rows is None:
            rows = self.rows
            active = ~self.done
            col = torch.where(active, self.gen, self.max_len)
            self.out_tok[rows, col] = tok
            self.out_lp[rows, col] = lp
            step = active.long()
            self.gen.add_(step)
            self.pos.add_(step)
            self.tok.copy_(torch.where(active, tok, self.tok))
            self.done.logical_or_(active & ((tok == self.eos_id) | (self.gen >= self.max_new)))
        else:  # every row of ``rows`` is live
            col = self.gen[rows]
            self.out_tok[rows, col] = tok
            self.out_lp[rows, col] = lp
            self.gen[rows] = col + 1
            self.pos[rows] = self.pos[rows] + 1
            self.tok[rows] = tok
            self.done[rows] = (tok == self.eos_id) | (col + 1 >= self.max_new[rows])

    def _live_rows(self) -> torch.Tensor | None:
        """The slots an eager step should run: ``None`` (all ``B``, the cache read as a view) while every
        row is live, else the live ones ``[n]`` (their K/V gathered). The tail of a batch steps fewer
        and fewer rows: a finished row waits for the loop's next sync (``sync_every`` steps) to be
        harvested, and with no prompt left to refill it, it would otherwise run through the model
        until the batch's longest response ends (19-26 % of a SmolLM2 8 x 8 x 24-token CPU batch's
        row-steps)."""
        live = (~self.done).nonzero().squeeze(1)
        return None if live.numel() == self.batch else live

    def attended_span(self, top: int) -> int:
        """Cache positions a decode step attends when the furthest row writes position ``top - 1``
        (the ``span`` argument of :meth:`decode_step`)."""
        if self.flex_decode:  # the block mask bounds each row: one graph
            return self.cache.max_span
        # graphs need few fixed shapes; eager steps attend what is written (whole blocks)
        bucket = self.span_bucket if self.graphs_on else self.cache.span_quantum
        return min(-(-top // bucket) * bucket, self.cache.max_span)

    def decode_step(self, span: int, greedy: bool) -> None:
        """One decode step of every live slot: feed ``tok [B]`` at ``pos [B]``, attend cache positions
        ``< span`` (:meth:`attended_span`), draw the next token into ``out_tok``/``out_lp`` and update
        ``tok``/``pos``/``gen``/``done`` in place. No host sync; with CUDA graphs, a replay of the
        graph captured for ``(span, greedy)`` (captured on first use)."""
        self.decode_steps += 1
        if not self.graphs_on:
            # A compiled step keeps the fixed batch shape; a plain eager one runs only the live rows.
            rows = None if self._compiled or self.flex_decode else self._live_rows()
            if rows is None:
                self._decode(span, greedy)
            elif rows.numel():
                self._decode(span, greedy, rows)
            return
        key = (span, greedy)
        if key not in self.graphs:
            self.graphs[key] = self._capture(span, greedy)
        self.graphs[key].replay()

    def _compile_decode(self) -> None:
        """Run the decode step's decoder layers and its tail (:meth:`_finish`) through ``torch.compile``
        from now on (prefills stay eager: their shapes vary).

        The layers, not the whole step: identical layers share one compiled graph (:meth:`_layers`
        hands each its buffers), so dynamo traces one layer instead of all of them. Traced whole,
        the 24-layer MoE step of ``gpu-long.yaml`` spent 6.1-8.8 s of an 8.4-11.9 s first call in
        dynamo's bytecode tracing on the H200 with a warm inductor cache (2,158 ops captured); that
        first call is in the first batch, which the learner waits for. Per layer the first call
        takes 5.1 s (21.7 s cold), decode speed unchanged (``tools/gpu/decode_first_call.py``).
        ``dynamic=None`` (automatic dynamic shapes): the first graph is specialised to the first
        span; the first step with another span recompiles once with the span symbolic, and every
        later span reuses that graph. With ``dynamic=False`` each span bucket was a compile of its
        own: 9 buckets x ~20 s for 1,088 positions on the H200, over 3 minutes before a worker's
        first 1k-token batch (``gpu-long.yaml``).
        """
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        self._compiled_layers = [torch.compile(layer, dynamic=None) for layer in self.layers]
        self._finish_fn, self._compiled = torch.compile(self._finish, dynamic=None), True

    def _plain_decode(self) -> None:
        """Back to the uncompiled step (a compilation failed)."""
        self._compiled_layers, self._finish_fn, self._compiled, self.compile = [], self._finish, False, False

    def _capture(self, span: int, greedy: bool) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (state saved and restored), then capture one decode step."""
        state = [self.tok, self.pos, self.gen, self.done, self.out_tok, self.out_lp]
        saved = [t.clone() for t in state]
        if self.compile and not self._compiled:
            self._compile_decode()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            try:
                self._decode(span, greedy)
            except Exception as e:  # noqa: BLE001 - compilation is an optimisation only
                if not self._compiled:
                    raise
                warnings.warn(f"FastHFEngine: torch.compile of the decode step failed ({e!r}); using the plain step")
                self._plain_decode()
                for t, v in zip(state, saved):
                    t.copy_(v)
                self._decode(span, greedy)
            self._decode(span, greedy)
        torch.cuda.current_stream().wait_stream(side)
        for t, v in zip(state, saved):
            t.copy_(v)
        graph = torch.cuda.CUDAGraph()
        # One pool for all graphs: no graph output outlives its replay (all writes go to the
        # persistent buffers above), so the graphs can share intermediates in any order.
        with torch.cuda.graph(graph, pool=self._pool):
            self._decode(span, greedy)
        self._pool = graph.pool()
        self.captures += 1
        return graph

    # ----------------------------------------------------------------------------- interface
    @torch.inference_mode()  # cheaper per op than no_grad (no version counters): the CPU loop is op-bound
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 between_steps: BetweenSteps | None = None, version: int = 0,
                 max_tokens: list[int] | None = None, stop: list[str] | None = None,
                 sessions: list | None = None) -> Generation:
        """Sample one response per prompt; ``temperature == 0`` is greedy. Slots refill as rows finish.

        ``between_steps`` (in-flight updates, see :data:`streamrl.engines.base.BetweenSteps`) is
        called before the first prefill and before every decode step; tokens are stamped with
        ``version`` until it returns an update, then with the update's version (``versions``).
        ``max_tokens[i]`` (optional): a smaller response cap for prompt ``i``. ``stop``
        (optional): strings that end a response like EOS does; the response keeps the token
        that completes one. They are checked when the loop syncs (every ``sync_every`` steps),
        so a row may decode a few tokens past its stop before it is cut and its slot refilled.
        ``sessions`` (optional, one distinct hashable id per prompt): keep each finished
        sequence's K/V under its id; a prompt whose session is kept prefills only what follows
        the reused prefix (``Generation.cached_tokens``). :meth:`release` frees a session.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        if max_tokens is not None and (len(max_tokens) != len(prompts) or min(max_tokens, default=1) < 1):
            raise ValueError(f"max_tokens: need one cap >= 1 per prompt ({len(prompts)}), got {max_tokens!r}")
        self._check_stop(stop)
        if sessions is not None:
            if len(sessions) != len(prompts) or len(set(sessions)) != len(sessions) or None in sessions:
                raise ValueError(f"sessions: need one distinct id per prompt ({len(prompts)}), got {sessions!r}")
            if self.routers:
                raise ValueError("sessions: kept K/V is not supported with record_routing (multi-turn has no routing)")
        caps = [min(max_new_tokens, max_tokens[j]) if max_tokens else max_new_tokens for j in range(len(prompts))]
        self._check_requests(prompts, caps, max_new_tokens, temperature)
        return self._run(DecodeLoop(self, prompts, caps, temperature == 0, between_steps, version, stop, sessions),
                         temperature)

    @torch.inference_mode()
    def generate_stream(self, refill: Callable[[int], list[list[int]] | None], on_finished: OnFinished,
                        max_new_tokens: int, temperature: float = 1.0, between_steps: BetweenSteps | None = None,
                        version: int = 0, max_tokens: Callable[[int], int] | None = None,
                        stop: list[str] | None = None) -> int:
        """Open-ended :meth:`generate`: keep every slot busy for as long as ``refill`` has prompts.

        At each sync (every ``sync_every`` steps) that leaves slots free, ``refill(free)`` is asked for
        at most ``free`` more prompts: ``[]`` (nothing now: asked again at the next sync, at once when
        no slot is busy) or None (no more ever: the held slots finish and the call returns). Request
        ``j`` is the ``j``-th prompt ``refill`` returned; as soon as its row finishes,
        ``on_finished(j, tokens, logprobs, versions, routed_experts)`` gets it (one row of
        :class:`~streamrl.engines.base.Generation`: ``versions`` with ``between_steps``, else None;
        ``routed_experts`` with routing recording, else None). ``max_tokens(j)`` (optional): a smaller
        cap for request ``j``. The rest as in :meth:`generate`, whose fixed list is this loop's special
        case. Returns the number of requests served.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        self._check_requests([], [], max_new_tokens, temperature)  # the temperature, before any prompt
        self._check_stop(stop)
        served = 0

        def more(free: int) -> tuple[list[list[int]], list[int]] | None:
            nonlocal served
            prompts = refill(free)
            if prompts is None:
                return None
            if len(prompts) > free:
                raise ValueError(f"refill({free}) returned {len(prompts)} prompts: at most {free}")
            caps = [min(max_new_tokens, max_tokens(served + i)) if max_tokens else max_new_tokens
                    for i in range(len(prompts))]
            if min(caps, default=1) < 1:
                raise ValueError(f"max_tokens: caps of requests {served}.. must be >= 1, got {caps!r}")
            self._check_requests(prompts, caps, max_new_tokens, temperature, first=served)
            served += len(prompts)
            return prompts, caps

        loop = DecodeLoop(self, [], [], temperature == 0, between_steps, version, stop, None,
                          refill=more, on_finished=on_finished)
        self._run(loop, temperature)
        return served

    def _check_stop(self, stop: list[str] | None) -> None:
        if stop and (self.tokenizer is None or not all(isinstance(x, str) and x for x in stop)):
            raise ValueError(f"stop = {stop!r}: needs non-empty strings and an engine built with a tokenizer")

    def _check_requests(self, prompts: list[list[int]], caps: list[int], max_new_tokens: int, temperature: float,
                        first: int = 0) -> None:
        """Raise ``ValueError`` naming the request (``first`` + its index) that cannot run."""
        if temperature < 0:
            raise ValueError(f"temperature = {temperature}: must be >= 0 (0 = greedy)")
        for i, q in enumerate(prompts):
            if not q or len(q) + max_new_tokens > self.max_len:
                raise ValueError(f"prompts[{first + i}]: length {len(q)} + max_new_tokens {max_new_tokens} "
                                 f"must be in [1, max_seq_len={self.max_len}]")
            if self.cache.blocks_for(len(q) + caps[i]) > self.cache.num_blocks - 1:
                raise ValueError(f"prompts[{first + i}]: length {len(q)} + cap {caps[i]} needs more KV blocks than "
                                 f"the pool holds ({self.cache.num_blocks - 1} of {self.cache.block_size})")

    def _run(self, loop: DecodeLoop, temperature: float) -> Generation:
        greedy = temperature == 0
        self.temp.fill_(1.0 if greedy else float(temperature))
        self.done.fill_(True)
        with self._impl():
            return loop.run()

    def release(self, sessions: list) -> None:
        """Free the kept K/V of ``sessions`` (an episode ended); unknown ids are ignored."""
        self.sessions.release(sessions)

    def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of ``seq[start:]``; one eager forward."""
        return teacher_forced_logprobs(self.model, sequences, start, self.pad_id, self.device)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (a full version) or merge (adapters, :mod:`streamrl.engines.adapter_merge`) into the
        existing parameter storage, all or nothing (captured graphs see it)."""
        self._weights.load(named_tensors)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.graphs.clear()
        self.cache = None
        self.model = None
        self._params = {}
