"""transformers engine: batched sampling with KV cache and behaviour log-probs."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from streamrl.engines.base import Generation


class HFEngine:
    """Generation with ``model.generate`` (KV cache), log-probs from the raw logits.

    Sampling uses the plain tempered softmax (no top-k/top-p), so the recorded
    ``log mu`` is exactly the distribution the learner's importance weights assume.
    """

    def __init__(self, model, tokenizer, device: str = "cpu"):
        self.model = model.to(device).eval()
        self.tok = tokenizer
        self.device = torch.device(device)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0) -> Generation:
        b = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps the last prompt token aligned
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )
        seq = out.sequences[:, width:].cpu()  # [B, T_new]
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, T_new, V]
        lp = F.log_softmax(logits / temperature, dim=-1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)
        tokens, logprobs = [], []
        for i in range(b):
            row = seq[i].tolist()
            n = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            tokens.append(row[:n])
            logprobs.append(lp[i, :n].tolist())
        return Generation(tokens=tokens, logprobs=logprobs)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the existing parameter storage, all or nothing.

        Names and shapes are checked for every tensor before the first copy, so a bad
        update raises without leaving the engine half-loaded.
        """
        items = list(named_tensors)
        names = {n for n, _ in items}
        unknown = names - set(self._params)
        missing = set(self._params) - names
        if unknown or missing:
            raise KeyError(f"weights update mismatch: unknown {sorted(unknown)[:3]}, missing {sorted(missing)[:3]}")
        for name, t in items:
            if tuple(t.shape) != tuple(self._params[name].shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} != engine {tuple(self._params[name].shape)}")
        for name, t in items:
            self._params[name].copy_(t)
