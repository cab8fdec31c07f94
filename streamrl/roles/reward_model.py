"""A learned reward model from an HF folder, scoring ``(prompt, response)`` pairs batch-wise.

Two kinds of folder are understood, told apart by the ``architectures`` in its config.json:

* **sequence classification** (``*ForSequenceClassification``, one label): the score is the
  head's logit at the last token of ``prompt + response`` (the usual Bradley-Terry RM);
* **causal LM** (``*ForCausalLM``): the score is the mean log-probability of the response
  tokens given the prompt (a likelihood judge; no extra head needed).

The same object serves in-process (``rollout.reward_model`` = the folder, loaded by each
worker) and inside the reward-model role (:mod:`streamrl.roles.reward_server`), so both give
the same numbers for the same batch. Texts are tokenized without special tokens added, the
prompt and the response separately and then joined, so the response boundary is exact.

Examples:
    >>> rm = HFRewardModel("path/to/rm", device="cpu")      # doctest: +SKIP
    >>> rm(["What is 2 + 3?"], ["5"])                      # doctest: +SKIP
    [0.731...]
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

MAX_TOKENS = 2048  # prompt + response tokens kept per pair (the prompt is cut from the left)


def is_reward_model_folder(spec: str) -> bool:
    """True when ``spec`` names an HF folder (a directory holding config.json)."""
    return bool(spec) and (Path(spec) / "config.json").is_file()


def reward_model_kind(folder: str) -> str:
    """``"classifier"`` or ``"causal"`` from the folder's config.json ``architectures``."""
    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "classifier"
    if any(a.endswith("ForCausalLM") for a in archs):
        return "causal"
    raise ValueError(f"rollout.reward_model = {folder!r}: architectures {archs} are neither "
                     "*ForSequenceClassification nor *ForCausalLM")


class HFRewardModel:
    """Callable ``(prompts: list[str], responses: list[str]) -> list[float]`` (one score each)."""

    def __init__(self, folder: str, device: str = "cpu", max_tokens: int = MAX_TOKENS):
        from transformers import (AutoModelForCausalLM,  # noqa: PLC0415 (heavy; only RM users pay)
                                  AutoModelForSequenceClassification, AutoTokenizer)

        self.folder, self.kind = folder, reward_model_kind(folder)
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.tok = AutoTokenizer.from_pretrained(folder)
        cls = AutoModelForSequenceClassification if self.kind == "classifier" else AutoModelForCausalLM
        self.model = cls.from_pretrained(folder).to(self.device).eval()
        if self.kind == "classifier" and self.model.config.num_labels != 1:
            raise ValueError(f"rollout.reward_model = {folder!r}: num_labels = {self.model.config.num_labels}; "
                             "a reward model has one output")
        if self.kind == "classifier":
            if not isinstance(getattr(self.model, "score", None), torch.nn.Linear):
                raise ValueError(f"rollout.reward_model = {folder!r}: {type(self.model).__name__} has no linear "
                                 "'score' head over a decoder (the layout of decoder reward models)")
            self.base = getattr(self.model, self.model.base_model_prefix)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else (self.tok.eos_token_id or 0)

    def _pairs(self, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``ids [B, T]``, ``mask [B, T]`` and ``response_start [B]`` (index of the
        first response token; the prompt is cut from the left to fit ``max_tokens``)."""
        seqs, starts = [], []
        for p, r in zip(prompts, responses):
            p_ids = self.tok.encode(p, add_special_tokens=False)
            r_ids = self.tok.encode(r, add_special_tokens=False)[: self.max_tokens - 1]
            p_ids = p_ids[max(0, len(p_ids) + len(r_ids) - self.max_tokens):]
            seqs.append(p_ids + r_ids)
            starts.append(len(p_ids))
        width = max(max(len(s) for s in seqs), 1)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        return ids, mask, torch.tensor(starts, dtype=torch.long)

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        if not prompts:
            return []
        ids, mask, starts = self._pairs(prompts, responses)
        ids, mask = ids.to(self.device), mask.to(self.device)
        lengths = mask.sum(-1)  # [B]
        if self.kind == "classifier":
            # The head at each pair's own last token, found from the mask: HF's own pooling looks
            # for the last token != pad_token_id, which a response containing that id would fool.
            hidden = self.base(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
            last = (lengths - 1).clamp(min=0)
            pooled = hidden[torch.arange(len(ids), device=self.device), last]  # [B, H]
            return self.model.score(pooled).float().squeeze(-1).tolist()
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        pos = torch.arange(1, ids.shape[1], device=self.device)[None]  # position of each predicted token
        in_response = (pos >= starts.to(self.device)[:, None]) & (pos < lengths[:, None])  # [B, T-1]
        n = in_response.sum(-1).clamp(min=1)
        return ((logp * in_response).sum(-1) / n).tolist()
