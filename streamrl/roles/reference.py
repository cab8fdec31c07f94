"""The KL reference policy, either inside the learner ranks or as its own role.

* **colocated** (``placement.reference`` null, the default): every learner rank holds the
  reference, FSDP-sharded like the policy, no gradient and no optimizer state
  (:class:`~streamrl.learner.trainer.Trainer` builds it with :func:`load_reference_model`);
* **separate** (``placement.reference`` set, ``learner.kl_coef > 0``): a reference server
  (:mod:`streamrl.workers.reference_server`) scores every batch between the rollout worker and
  the learner; the log-probs travel in the trajectory as ``ref_logprobs`` and the learner's
  KL term reads them (:func:`served_ref_logprobs`) instead of running a model.

Both compute ``log softmax(logits / rollout.temperature)`` of each response token given the
prompt and the response before it, in float32, so the KL term is the same up to float
rounding (the learner's packed forward vs the server's padded one).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from tensordict import TensorDict

from streamrl.config import Config
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.packing import response_grid
from streamrl.roles.names import REFERENCE

ROLE = REFERENCE


def reference_role_configured(cfg: Config) -> bool:
    """Whether the reference runs as its own process (workers then send it every batch)."""
    return bool(cfg.placement.reference) and cfg.learner.kl_coef > 0


def load_reference_model(cfg: Config, policy: torch.nn.Module | None = None) -> torch.nn.Module:
    """The reference model: ``reference.path`` when set, else the initial policy (a copy of
    ``policy`` when given, else built/loaded from ``model`` with the run's seed); eval mode,
    no gradient."""
    from streamrl.models.factory import load_model_and_tokenizer  # noqa: PLC0415 (heavy)

    if cfg.reference.path:
        model = load_model_and_tokenizer(dataclasses.replace(cfg.model, path=cfg.reference.path), cfg.run.seed)[0]
        if policy is not None and model.config.vocab_size != policy.config.vocab_size:
            raise ValueError(f"reference.path = {cfg.reference.path!r}: vocab_size {model.config.vocab_size} != the "
                             f"policy's {policy.config.vocab_size}; the reference must share the policy's tokenizer")
    elif policy is not None:
        model = copy.deepcopy(policy)
    else:
        model = load_model_and_tokenizer(cfg.model, cfg.run.seed)[0]
    return model.requires_grad_(False).eval()


def served_ref_logprobs(batch: TensorDict, rows: list[int]) -> torch.Tensor:
    """The reference server's log-probs of trajectories ``rows`` on the response grid ``[b, R]``."""
    if "ref_logprobs" not in batch.keys():
        raise ValueError("placement.reference runs the reference as its own process, but this batch has no "
                         "ref_logprobs: were its rollout workers started with the same config?")
    return response_grid(batch, "ref_logprobs")[rows]


class ReferenceScorer:
    """``fields -> (ref_logprobs [R] float32, 0)``: log-probs of every response token.

    Args:
        model: a causal LM (eval mode). temperature: ``rollout.temperature`` (the learner's too).
        max_tokens: padded tokens (rows x longest sequence) per forward.
    """

    def __init__(self, model: torch.nn.Module, temperature: float, max_tokens: int = 8192,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.temperature, self.max_tokens = temperature, max_tokens

    @torch.no_grad()
    def __call__(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        p_lens, r_lens = fields["prompt_lens"].tolist(), fields["response_lens"].tolist()
        p_off = [0, *torch.tensor(p_lens).cumsum(0).tolist()]
        r_off = [0, *torch.tensor(r_lens).cumsum(0).tolist()]
        seqs = [torch.cat([fields["prompt_tokens"][p_off[i]:p_off[i + 1]],
                           fields["response_tokens"][r_off[i]:r_off[i + 1]]]) for i in range(len(p_lens))]
        out = []
        start = 0
        while start < len(seqs):  # rows in chunks of at most max_tokens padded tokens
            stop, width = start, 0
            while stop < len(seqs) and (stop == start or max(width, len(seqs[stop])) * (stop + 1 - start)
                                        <= self.max_tokens):
                width = max(width, len(seqs[stop]))
                stop += 1
            out += self._score_rows(seqs[start:stop], p_lens[start:stop], r_lens[start:stop], width)
            start = stop
        return torch.cat(out), 0

    def _score_rows(self, seqs, p_lens, r_lens, width) -> list[torch.Tensor]:
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], attn[i, : len(s)] = s, 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False).logits
        logp = token_logprobs(logits, ids.to(self.device), self.temperature).cpu()  # [b, width-1]
        # response token j of row i sits at p+j and is predicted at position p+j-1
        return [logp[i, p - 1 : p - 1 + r] for i, (p, r) in enumerate(zip(p_lens, r_lens))]
