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
    """Session id -> :class:`Kept`, least recently kept first."""

    def __init__(self):
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

    def handles(self) -> list[Any]:
        return [k.handle for k in self._kept.values()]
