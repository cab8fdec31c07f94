"""transformers engine: batched sampling with KV cache, behaviour log-probs, routing capture.

Sampling uses the plain tempered softmax (no top-k/top-p), so the recorded ``log mu`` is
exactly the distribution the learner's importance weights assume. The model folder's
``generation_config.json`` (repetition penalty, min-p, top-k, ...) is switched off: transformers
fills every field a call leaves unset from ``model.generation_config``, so the engine replaces
that with a neutral config, and it scores the *processed* scores ``generate()`` sampled from
(on the device, the drawn token only), so nothing can reshape the distribution unrecorded.
With ``record_routing``
a forward hook on every MoE router keeps the top-k expert ids of each generation step, so
trajectories can carry ``routed_experts`` for routing replay in the learner.

Multi-turn episodes re-prefill the whole conversation every turn here (``model.generate``
keeps no KV between calls); that is cheap at the tiny model's lengths. The fast engine keeps
each episode's KV between turns (:mod:`streamrl.engines.kv_sessions`).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from streamrl.engines.adapter_merge import EngineWeights
from streamrl.engines.base import Generation, teacher_forced_logprobs


def find_routers(model) -> list[torch.nn.Module]:
    """MoE router modules in layer order (transformers 5 ``*TopKRouter``: returns logits, weights, ids)."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "weight")]


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` (token ids, any lengths) as ``generate()`` input: ids and attention mask, both
    int64 [B, width], padded on the left so every row's last prompt token is aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    return ids, attn


def through_eos(row: list[int], eos_id: int | None) -> int:
    """How many of a ``generate()`` row's new tokens are the answer: up to and including its first
    EOS (``generate`` pads the rest), or all of them when it has none."""
    return row.index(eos_id) + 1 if eos_id is not None and eos_id in row else len(row)


def neutral_generation_config(eos_id: int | None, pad_id: int | None) -> GenerationConfig:
    """A generation config with no logits processor of its own (library defaults only).

    ``generate()`` fills every field a call leaves unset from ``model.generation_config``; with
    this one in its place a folder's ``repetition_penalty``, ``min_p``, ``top_k``, bad words,
    minimum lengths etc. cannot reshape the sampling distribution behind the recorded log-probs.
    """
    return GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)


class HFEngine:
    """Generation with ``model.generate`` (KV cache), log-probs from the raw logits (float32).

    Computes in ``model``'s dtype; ``lora_base``: ``W0`` of adapted projections in the learner's
    dtype when ``model`` is a cast copy (:func:`~streamrl.engines.precision.cast_for_engine`).
    """

    name = "hf"

    def __init__(self, model, tokenizer, device: str = "cpu", record_routing: bool = False,
                 lora_base: dict[str, torch.Tensor] | None = None):
        self.model = model.to(device).eval()
        self.tok = tokenizer
        self.device = torch.device(device)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        # The sampling distribution is the behaviour policy: nothing from the folder may reshape it.
        self.model.generation_config = neutral_generation_config(self.eos_id, self.pad_id)
        self._params = dict(self.model.named_parameters())
        self._weights = EngineWeights(self._params, lora_base)
        self.routers = find_routers(self.model) if record_routing else []
        self._steps: list[list[torch.Tensor]] | None = None  # per forward: per layer [N, k]
        for layer_idx, router in enumerate(self.routers):
            router.register_forward_hook(self._make_hook(layer_idx))

    def _make_hook(self, layer_idx: int):
        def hook(module, args, output):
            if self._steps is None:
                return
            ids = output[2]  # [N_tokens, k]
            if layer_idx == 0:
                self._steps.append([])
            self._steps[-1].append(ids.detach().to("cpu", torch.int16))
        return hook

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0) -> Generation:
        b = len(prompts)
        ids, attn = left_padded(prompts, self.pad_id)
        width = ids.shape[1]
        self._steps = [] if self.routers else None
        try:
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
                pad_token_id=self.pad_id, eos_token_id=self.eos_id,
            )
            steps, self._steps = self._steps, None
        finally:
            self._steps = None
        seq_dev = out.sequences[:, width:]  # [B, T_new]
        lp = torch.empty(seq_dev.shape, dtype=torch.float32, device=seq_dev.device)
        for t, scores in enumerate(out.scores):  # [B, V] each: the tempered logits multinomial drew from
            lp[:, t] = F.log_softmax(scores.float(), dim=-1).gather(-1, seq_dev[:, t:t + 1]).squeeze(-1)
        seq, lp = seq_dev.cpu(), lp.cpu()
        routing = self._routing_tensor(steps, b, width, seq.shape[1]) if steps else None  # [B, T, L, k]
        tokens, logprobs, routed = [], [], []
        for i in range(b):
            row = seq[i].tolist()
            n = through_eos(row, self.eos_id)
            tokens.append(row[:n])
            logprobs.append(lp[i, :n].tolist())
            if routing is not None:
                routed.append(routing[i, :n].contiguous())
        return Generation(tokens=tokens, logprobs=logprobs, routed_experts=routed if routing is not None else None)

    @staticmethod
    def _routing_tensor(steps: list[list[torch.Tensor]], b: int, width: int, t_new: int) -> torch.Tensor:
        """Per-token routing ``[B, T_new, L, k]`` from the hooked forwards.

        Forward 0 is the prefill over ``[B, width]``; its last position predicts token 0.
        Forward s >= 1 feeds token s-1 and predicts token s.
        """
        per_step = []
        for s, layers in enumerate(steps[:t_new]):
            stacked = torch.stack(layers, dim=1)  # [N, L, k]
            if s == 0:
                stacked = stacked.view(b, width, *stacked.shape[1:])[:, -1]
            per_step.append(stacked.view(b, *stacked.shape[-2:]))
        return torch.stack(per_step, dim=1)

    def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of ``seq[start:]``; one eager forward."""
        return teacher_forced_logprobs(self.model, sequences, start, self.pad_id, self.device)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (a full version) or merge (adapters, :mod:`streamrl.engines.adapter_merge`) into the
        existing parameter storage, all or nothing (captured graphs see it)."""
        self._weights.load(named_tensors)

    def close(self) -> None:
        self.model = None
        self._params = {}
