"""KV kept between generate calls of the fast engine: multi-turn episodes prefill only the new turn.

A multi-turn episode (:mod:`streamrl.envs.episode`) sends each turn's prompt as exactly the
previous prompt + the model's response + the tool's reply. Re-prefilling that whole
conversation every turn costs O(turns^2) prompt tokens; keeping the sequence's K/V after its
turn ends makes the next turn prefill only the tool reply (and the last response token, whose
K/V the decode loop never computed).

``FastHFEngine.generate(..., sessions=[...])`` names each prompt's session. When a sequence is
harvested its K/V stays in the cache under that name (:class:`KeptSessions`, least recently
used first): the static cache keeps the slot, the paged cache keeps the blocks (detached from
any slot). A later prompt of the same session reuses the longest common prefix of the kept
tokens and the new prompt (:func:`reusable_prefix`) and prefills the rest. When the engine runs
short (static: no free slot; paged: no free block) it evicts kept sessions, least recently
used first, and such a prompt is prefilled in full: the same result, more compute.
``release(sessions)`` frees a session whose episode ended.

Weight updates: a kept K/V was computed by the weights loaded when it was written; it is kept
across updates, as K/V computed before an in-flight update is kept inside a turn (vLLM and
SGLang keep in-flight requests' KV the same way). The tokens sampled after the update carry the
new version and their behaviour log-probs are exactly what the engine computed (new weights on
the kept prefix), which is what the learner's importance ratios need.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable


@dataclass
class Kept:
    """A finished sequence's K/V: ``tokens`` at positions ``0..len-1``; ``handle`` is the cache's
    (static: the slot; paged: the block list)."""

    tokens: list[int]
    handle: Any


def reusable_prefix(kept: list[int], prompt: list[int]) -> int:
    """Positions of ``prompt`` whose kept K/V can be reused: the longest common prefix, leaving at
    least the prompt's last token to run (its logits draw the first response token)."""
    n = min(len(kept), len(prompt) - 1)
    i = 0
    while i < n and kept[i] == prompt[i]:
        i += 1
    return i


class KeptSessions:
    """Session id -> :class:`Kept`, least recently kept first, over the engine's KV cache.

    cache: the engine's :class:`~streamrl.engines.static_kv.StaticKVCache` (a session keeps its
    slot: ``slot_bound``) or :class:`~streamrl.engines.paged_kv.PagedKVCache` (it keeps blocks).
    """

    def __init__(self, cache, slot_bound: bool):
        self.cache, self.slot_bound = cache, slot_bound
        self._kept: OrderedDict[Hashable, Kept] = OrderedDict()
        self.evictions = 0  # sessions dropped because the cache ran short

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, sid: Hashable) -> bool:
        return sid in self._kept

    def get(self, sid: Hashable) -> Kept | None:
        return self._kept.get(sid)

    def put(self, sid: Hashable, kept: Kept) -> None:
        self._kept.pop(sid, None)
        self._kept[sid] = kept

    def pop(self, sid: Hashable) -> Kept | None:
        return self._kept.pop(sid, None)

    def victim(self, wanted: Iterable[Hashable] = (), spare: Hashable | None = None) -> Hashable | None:
        """The session to evict: the least recently kept one no queued prompt wants, else the
        least recently kept one; never ``spare``; None when there is none."""
        wanted = set(wanted)
        order = [sid for sid in self._kept if sid != spare]
        return next((sid for sid in order if sid not in wanted), order[0] if order else None)

    def keep(self, sid: Hashable, tokens: list[int], slot: int) -> None:
        """Keep slot ``slot``'s K/V of ``tokens`` (positions ``0..len-1``) under ``sid``."""
        self.put(sid, Kept(tokens, self.cache.detach(slot, len(tokens))))

    def release(self, sids: Iterable[Hashable]) -> None:
        """Free the K/V of ``sids``; unknown ids are ignored."""
        for sid in sids:
            kept = self._kept.pop(sid, None)
            if kept is not None:
                self.cache.drop(kept.handle)

    def evict(self, wanted: Iterable[Hashable] = (), spare: Hashable | None = None) -> bool:
        """Free the :meth:`victim`'s K/V; False when nothing can be evicted."""
        sid = self.victim(wanted, spare)
        if sid is None:
            return False
        self.release([sid])
        self.evictions += 1
        return True

    def open_slot(self, free: list[int], wanted: Iterable[Hashable]) -> int | None:
        """A slot of ``free`` for a prompt without kept K/V: with slot-bound sessions one no session
        keeps, else the slot of an evicted one; otherwise any."""
        if not self.slot_bound:
            return free[0] if free else None
        kept = {k.handle for k in self._kept.values()}
        open_ = [s for s in free if s not in kept]
        if open_:
            return open_[0]
        sid = self.victim(wanted)
        if sid is None:
            return None
        slot = self._kept[sid].handle
        self.release([sid])
        self.evictions += 1
        return slot
