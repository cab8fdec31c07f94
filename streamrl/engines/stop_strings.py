"""Stop strings of the fast engine: cut a response after the token that completes one.

The decode loop checks at each ``done`` read (every ``sync_every`` steps) and only the tokens
decoded since the previous check, plus a window as long as the longest stop string so that a
stop split across two checks is found. A cut row is marked done on the device with its token
count set to the cut length, so the harvest keeps exactly those tokens and its slot is refilled
like an EOS row's.
"""
from __future__ import annotations

import numpy as np
import torch

from streamrl.engines.host_io import to_device


class StopStrings:
    """Search decoded responses for ``stop`` (non-empty strings) with ``tokenizer``."""

    def __init__(self, stop: list[str], tokenizer):
        self.stop, self.tokenizer = stop, tokenizer
        self.window = max(len(x) for x in stop)

    def _found(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens)
        return any(x in text for x in self.stop)

    def cut(self, slots: np.ndarray, checked: np.ndarray, gen: torch.Tensor, out_tok: torch.Tensor,
            done: torch.Tensor) -> None:
        """End the responses of ``slots`` that now contain a stop string.

        checked: numpy ``[B]`` response tokens already searched per slot (advanced here);
        gen: device ``[B]`` tokens drawn; out_tok: device ``[B, S+1]`` response tokens;
        done: device ``[B]`` bool. Reads ``gen`` and the new tokens (a host sync).
        """
        if not len(slots):
            return
        idx = to_device(torch.from_numpy(slots), gen.device)
        n = gen[idx].cpu().tolist()
        starts = [max(0, int(checked[s]) - self.window) for s in slots]
        lo, hi = min(starts), max(n)
        toks = out_tok[idx, lo:hi].cpu().tolist()
        cut_rows, cut_lens = [], []
        for r, s in enumerate(slots.tolist()):
            row = toks[r][starts[r] - lo: n[r] - lo]
            checked[s] = n[r]
            if not self._found(row):
                continue
            k = next(k for k in range(1, len(row) + 1) if self._found(row[:k]))  # shortest completing prefix
            cut_rows.append(s)
            cut_lens.append(starts[r] + k)
        if cut_rows:
            rows = to_device(cut_rows, gen.device)
            gen[rows] = to_device(cut_lens, gen.device)
            done[rows] = True
