"""The engine interface a rollout worker needs: generate with log-probs, load weights."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch


@dataclass
class Generation:
    """Sampled responses of one generate call (ragged, no padding).

    tokens[i]: response token ids of sequence i (ending with EOS if it stopped).
    logprobs[i]: log mu(token) of each response token under the sampling distribution.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> Generation:
        """Sample one response per prompt (repeat prompts for groups)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place; the next generate uses only the new weights."""
