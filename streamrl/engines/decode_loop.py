"""One ``FastHFEngine.generate`` (or ``generate_stream``) call: the request queue, refills, harvests,
preemptions, versions.

The engine (:mod:`streamrl.engines.hf_fast`) owns the model, the KV cache, the device-side slot
state (``tok``/``pos``/``gen``/``done``/``max_new`` ``[B]``, ``out_tok``/``out_lp`` ``[B, S+1]``)
and the decode step (its public methods ``prefill``, ``extend``, ``attended_span``,
``decode_step``); this loop decides what runs in which slot and when:

* every decode step: O(1) Python. The host's slot state is a :class:`SlotTable` of step counters,
  the weight versions a :class:`VersionLog` of change points, and nothing is copied between host
  and device (paged block-table edits go through pinned memory without waiting), so the host
  queues steps ahead of the GPU;
* every ``sync_every`` steps (or when no slot is live): stop strings are searched, the ``done``
  flags read (the loop's one wait for the device), finished rows harvested and their slots
  refilled from the queue (prefill, or a kept session's extension).

With a paged cache a slot whose next position opens a block takes one from the pool; when the
pool is empty, kept sessions are evicted first, then the least advanced sequence is preempted
(its blocks freed, its request queued again from the start).

A fixed request list (``generate``) and an open-ended stream (``generate_stream``) are the same
loop: with a ``refill`` callback, every sync that leaves more free slots than queued requests asks
it for more (None: no more ever, so the loop drains and returns), and with ``on_finished`` every
harvested sequence is handed over at once instead of being collected into a :class:`Generation`.
A request's prompt and cap are dropped when it is harvested, so a stream holds only what is in
flight.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import torch

from streamrl.engines.base import BetweenSteps, Generation
from streamrl.engines.host_io import to_device
from streamrl.engines.kv_sessions import reusable_prefix
from streamrl.engines.slot_table import SlotTable, VersionLog
from streamrl.engines.stop_strings import StopStrings


Refill = Callable[[int], Optional[tuple[list[list[int]], list[int]]]]
"""``refill(free) -> (prompts, caps) | None``: up to ``free`` more requests (validated by the engine),
or None when no more will ever come. Request ``j`` is the ``j``-th prompt handed in, counted from 0."""

OnFinished = Callable[[int, list[int], list[float], Optional[list[int]], Optional[torch.Tensor]], None]
"""``on_finished(j, tokens, logprobs, versions, routed_experts)`` of request ``j``, as soon as it is
harvested (the fields of one row of :class:`Generation`; ``versions``/``routed_experts`` may be None)."""


class DecodeLoop:
    """Generate one response per request on ``engine`` (see ``FastHFEngine.generate`` and ``generate_stream``).

    prompts, caps: the requests known up front and their response caps; stop: stop strings or
    None; sessions: one session id per prompt or None (fixed lists only); refill: more requests
    while the loop runs (None: the list is fixed); on_finished: where harvested sequences go (None:
    collected and returned by :meth:`run`). Inputs are validated by the engine.
    """

    def __init__(self, engine, prompts: list[list[int]], caps: list[int], greedy: bool,
                 between_steps: BetweenSteps | None, version: int, stop: list[str] | None,
                 sessions: list | None, refill: Refill | None = None, on_finished: OnFinished | None = None):
        assert sessions is None or refill is None, "kept sessions need the whole request list up front"
        self.eng, self.greedy = engine, greedy
        self.between_steps, self.sessions, self.refill = between_steps, sessions, refill
        self.on_finished = on_finished or self._collect
        self.stops = StopStrings(stop, engine.tokenizer) if stop else None
        self.prompts: dict[int, list[int]] = {}  # requests not yet harvested
        self.caps: dict[int, int] = {}
        self.requests = 0                        # requests handed in so far
        self.queue: deque[int] = deque()
        self._add(prompts, caps)
        self.table = SlotTable(engine.batch)
        self.versions = VersionLog(version) if between_steps is not None else None
        n = len(prompts)
        self.out_t: list = [None] * n
        self.out_l: list = [None] * n
        self.out_r: list = [None] * n
        self.out_v: list = [None] * n
        self.cached = [0] * n  # prompt tokens a kept session supplied

    def _add(self, prompts: list[list[int]], caps: list[int]) -> None:
        for q, c in zip(prompts, caps):
            self.prompts[self.requests], self.caps[self.requests] = q, c
            self.queue.append(self.requests)
            self.requests += 1

    def _collect(self, j: int, tokens, logprobs, versions, routed) -> None:
        """The fixed list's ``on_finished``: request ``j``'s row of the returned :class:`Generation`."""
        self.out_t[j], self.out_l[j], self.out_v[j], self.out_r[j] = tokens, logprobs, versions, routed

    # ------------------------------------------------------------------ the loop
    def run(self) -> Generation:
        eng, t = self.eng, self.table
        self._poll(0)
        self._admit()
        while t.held or self.refill is not None:
            if self._grow():
                self._poll(t.steps + 1)
                eng.decode_step(eng.attended_span(t.top_position() + 1), self.greedy)
                t.steps += 1
            if not t.any_live() or t.steps % eng.sync_every == 0:
                self._sync()
        return Generation(tokens=self.out_t, logprobs=self.out_l,
                          routed_experts=self.out_r if eng.routers else None,
                          versions=self.out_v if self.versions is not None else None,
                          cached_tokens=self.cached if self.sessions is not None else None)

    def _poll(self, step: int) -> None:
        """Ask ``between_steps`` for an update; its weights and version hold from decode step ``step``."""
        update = self.between_steps() if self.between_steps is not None else None
        if update is not None:
            self.eng.load_weights(update[1])
            self.versions.set(step, int(update[0]))

    def _sync(self) -> None:
        """Stop strings, the ``done`` read, harvest and refill."""
        eng, t = self.eng, self.table
        t0 = time.perf_counter()
        if self.stops is not None:
            self.stops.cut(t.owned(), t.checked, eng.gen, eng.out_tok, eng.done)
        done = eng.done.cpu().numpy()  # waits for every queued step: the loop's one host sync
        eng.sync_wait_s += time.perf_counter() - t0
        owned = t.owned()
        finished = owned[done[owned]]
        if finished.size:
            self._harvest(finished.tolist())
        self._admit()

    def _admit(self) -> None:
        """Fill free slots from the queue, first asking ``refill`` for what the queue lacks."""
        if not self.queue and self.refill is None:
            return
        free = self.table.free_slots()  # freed now, or earlier but then short of KV blocks
        if self.refill is not None and len(free) > len(self.queue):
            more = self.refill(len(free) - len(self.queue))
            if more is None:
                self.refill = None  # drain: the loop ends once the held slots finish
            else:
                self._add(*more)
        if self.queue and free:
            self._fill(free)

    # ------------------------------------------------------------------ slots in and out
    def _wanted(self) -> list:
        return [self.sessions[j] for j in self.queue] if self.sessions is not None else []

    def _fill(self, free: list[int]) -> None:
        """Admit queued requests into ``free`` slots while the KV pool has room for each prompt and
        its first decoded position (counted as if unshared: sharing only uses less). Static caches
        always have room; a prompt whose session is kept reuses its K/V (static: in its slot)."""
        eng, queue, prompts = self.eng, self.queue, self.prompts
        free, reserved, fresh, resumed = list(free), 0, [], []
        while queue and free:
            j = queue[0]
            sid = self.sessions[j] if self.sessions is not None else None
            kept = eng.sessions.get(sid) if sid is not None else None
            start = reusable_prefix(kept.tokens, prompts[j]) if kept is not None else 0
            if kept is not None and start == 0:  # nothing in common: the kept K/V is of no use
                eng.release([sid])
                kept = None
            slot = kept.handle if kept is not None and not eng.paged else eng.sessions.open_slot(free, self._wanted())
            if slot is None:
                break
            need = eng.cache.blocks_for(len(prompts[j]) + 1)
            if kept is not None:
                need += eng.cache.extra_blocks_to_resume(kept.handle, start)
            while need > eng.cache.free_blocks - reserved and eng.sessions.evict(self._wanted(), spare=sid):
                pass
            if need > eng.cache.free_blocks - reserved:
                break
            queue.popleft()
            free.remove(slot)
            if kept is None:
                reserved += need
                fresh.append((j, slot))
                continue
            eng.sessions.pop(sid)
            eng.cache.attach(slot, kept.handle, start)
            reserved += eng.cache.blocks_for(len(prompts[j]) + 1) - eng.cache.blocks_for(start)
            resumed.append((j, slot, start))
        chosen = fresh + [(j, s) for j, s, _ in resumed]
        if not chosen:
            return
        eng.max_new[to_device([s for _, s in chosen], eng.device)] = to_device([self.caps[j] for j, _ in chosen],
                                                                               eng.device)
        if fresh:
            eng.prefill([s for _, s in fresh], [prompts[j] for j, _ in fresh], self.greedy)
        if resumed:
            eng.extend([s for _, s, _ in resumed], [prompts[j] for j, _, _ in resumed],
                        [st for _, _, st in resumed], self.greedy)
        if self.sessions is not None:
            for j, _ in fresh:
                self.cached[j] = 0
            for j, _, st in resumed:
                self.cached[j] = st
        self.table.admit([s for _, s in chosen], [j for j, _ in chosen], [len(prompts[j]) for j, _ in chosen],
                         [self.caps[j] for j, _ in chosen])

    def _harvest(self, slots: list[int]) -> None:
        """Copy the finished rows of ``slots`` out, keep their K/V as sessions or free it."""
        eng, t = self.eng, self.table
        idx = to_device(slots, eng.device)
        n = eng.gen[idx].cpu().tolist()
        width = max(n)
        toks, lps = eng.out_tok[idx, :width].cpu(), eng.out_lp[idx, :width].cpu()
        hist = eng.route_hist[idx].cpu() if eng.route_hist is not None else None
        for r, s in enumerate(slots):
            j = int(t.owner[s])
            prompt = self.prompts.pop(j)
            del self.caps[j]
            tokens = toks[r, : n[r]].tolist()
            routed = None
            if hist is not None:  # position P-1+i predicted response token i
                p0 = len(prompt) - 1
                routed = hist[r, p0: p0 + n[r]].clone()
            versions = self.versions.tokens(int(t.admit_step[s]), n[r]) if self.versions is not None else None
            if self.sessions is not None:  # the last drawn token was never fed: its K/V is not there
                eng.sessions.keep(self.sessions[j], prompt + tokens[:-1], s)
            self.on_finished(j, tokens, lps[r, : n[r]].tolist(), versions, routed)
        t.free(slots)
        if self.sessions is None:
            eng.cache.release(slots)

    def _preempt(self, s: int) -> None:
        """Give up slot ``s``'s sequence (pool exhausted): free its blocks, queue its request again."""
        eng = self.eng
        eng.cache.release([s])
        eng.done[s] = True
        self.queue.appendleft(int(self.table.owner[s]))
        self.table.free([s])
        eng.preemptions += 1

    def _grow(self) -> bool:
        """Paged: a block for each live slot whose next position opens one, preempting the least
        advanced sequence on shortage. Returns whether any slot is live (takes the next step)."""
        eng, t = self.eng, self.table
        if not eng.paged:  # a static slot always has room
            return t.any_live()
        while True:
            live = t.live()
            if not live.size:
                return False
            opening = t.crossing(eng.cache.block_size)
            if not opening.size:
                return True
            if not eng.cache.grow(opening.tolist(), (t.positions(opening) + 1).tolist()):
                return True
            if eng.sessions.evict(self._wanted()):  # kept sessions go before running sequences
                continue
            self._preempt(t.least_advanced(live))

