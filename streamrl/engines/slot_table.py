"""Host-side state of the fast engine's decode slots, kept as step counters (O(1) Python per step).

Every live slot advances by exactly one position per decode step, so the host need not touch
each slot every step: a slot stores the step count at which it was filled (``admit_step``), its
prompt length and its response cap, and its position, tokens drawn and liveness follow from the
current step count. The values are upper bounds (a row that drew EOS on the device keeps them
until the next ``done`` read), exactly as a per-slot counter incremented every step would be.

:class:`VersionLog` records the weight version as change points ``(step, version)`` instead of a
list per slot, so an in-flight update costs O(1) per step and a harvested response's versions
are read off once.
"""
from __future__ import annotations

import bisect

import numpy as np


class SlotTable:
    """Owner, admission step, prompt length and cap of each of ``batch`` slots (numpy ``[B]``).

    A slot filled when ``steps == a`` with a prompt of ``P`` tokens and cap ``c`` has drawn
    ``g = min(1 + steps - a, c)`` tokens (the first at the prefill) and its next position is
    ``P + g - 1``; it is live (takes part in the next decode step) while ``g < c``, i.e. while
    ``steps < a + c - 1``.
    """

    def __init__(self, batch: int):
        self.owner = np.full(batch, -1, dtype=np.int64)     # request index held by each slot; -1 free
        self.admit_step = np.zeros(batch, dtype=np.int64)   # decode steps taken when it was filled
        self.prompt_len = np.zeros(batch, dtype=np.int64)
        self.cap = np.zeros(batch, dtype=np.int64)          # response cap of the slot's request
        self.checked = np.zeros(batch, dtype=np.int64)      # response tokens searched for stop strings
        self.steps = 0                                      # decode steps taken in this generate call
        self.held = 0                                       # slots holding a request
        self._end = np.zeros(batch, dtype=np.int64)         # steps count at which the slot stops being live
        self._dirty = True
        self._live = np.zeros(0, dtype=np.int64)
        self._next_change = 0    # steps count at which the live set shrinks next
        self._top_offset = 0     # max over live slots of prompt_len - admit_step

    # ------------------------------------------------------------------ changes (at syncs only)
    def admit(self, slots: list[int], owners: list[int], prompt_lens: list[int], caps: list[int]) -> None:
        s = np.asarray(slots, dtype=np.int64)
        self.owner[s], self.prompt_len[s], self.cap[s] = owners, prompt_lens, caps
        self.admit_step[s], self.checked[s] = self.steps, 0
        self._end[s] = self.steps + self.cap[s] - 1
        self.held = int((self.owner >= 0).sum())
        self._dirty = True

    def free(self, slots) -> None:
        self.owner[np.asarray(slots, dtype=np.int64)] = -1
        self.held = int((self.owner >= 0).sum())
        self._dirty = True

    # ------------------------------------------------------------------ reads
    def owned(self) -> np.ndarray:
        """Slots holding a request, ascending."""
        return np.flatnonzero(self.owner >= 0)

    def free_slots(self) -> list[int]:
        return np.flatnonzero(self.owner < 0).tolist()

    def gen(self, slots: np.ndarray) -> np.ndarray:
        """Tokens each of ``slots`` has drawn (upper bound)."""
        return np.minimum(1 + self.steps - self.admit_step[slots], self.cap[slots])

    def positions(self, slots: np.ndarray) -> np.ndarray:
        """Position each of ``slots`` writes at the next step."""
        return self.prompt_len[slots] + self.gen(slots) - 1

    def _refresh(self) -> None:
        if self._dirty or self.steps >= self._next_change:
            live = np.flatnonzero((self.owner >= 0) & (self.steps < self._end))
            self._live = live
            self._next_change = int(self._end[live].min()) if live.size else 1 << 62
            self._top_offset = int((self.prompt_len[live] - self.admit_step[live]).max()) if live.size else 0
            self._dirty = False

    def live(self) -> np.ndarray:
        """Slots that take part in the next decode step, ascending (recomputed only when it changes)."""
        self._refresh()
        return self._live

    def any_live(self) -> bool:
        self._refresh()
        return self._live.size > 0

    def top_position(self) -> int:
        """Largest position a live slot writes at the next step (call only with a live slot)."""
        self._refresh()
        return self._top_offset + self.steps

    def crossing(self, block_size: int) -> np.ndarray:
        """Live slots whose next position opens a new block of ``block_size`` positions."""
        live = self.live()
        return live[(self.prompt_len[live] - self.admit_step[live] + self.steps) % block_size == 0]

    def least_advanced(self, candidates: np.ndarray) -> int:
        """The slot of ``candidates`` with the fewest tokens drawn (ties: the highest slot)."""
        gen = self.gen(candidates)
        tied = candidates[gen == gen.min()]
        return int(tied.max())


class VersionLog:
    """Weight version of every decode step as change points; step 0 is the first prefill."""

    def __init__(self, version: int):
        self._steps = [0]
        self._versions = [int(version)]

    @property
    def current(self) -> int:
        return self._versions[-1]

    def set(self, step: int, version: int) -> None:
        """From decode step ``step`` on (this step included), tokens are drawn by ``version``."""
        if version == self._versions[-1]:
            return
        if self._steps[-1] == step:
            self._versions[-1] = int(version)
        else:
            self._steps.append(step)
            self._versions.append(int(version))

    def tokens(self, admit_step: int, n: int) -> list[int]:
        """Versions of a response's ``n`` tokens: token 0 drawn at the fill after step ``admit_step``,
        token ``t`` at decode step ``admit_step + t``."""
        out: list[int] = []
        i = bisect.bisect_right(self._steps, admit_step) - 1  # change point in force at token 0
        step = admit_step
        while len(out) < n:  # one run of equal versions per change point
            until = self._steps[i + 1] if i + 1 < len(self._steps) else admit_step + n
            out += [self._versions[i]] * (min(until, admit_step + n) - step)
            step, i = until, i + 1
        return out
