"""The critic role: a value model of its own (``critic.path``, may be smaller than the policy),
scoring every batch between the rollout worker and the learner and training itself on them.

Why this shape (over a critic trained by the learner): the value model's forward, backward
and optimizer state live on ``placement.critic``, not on the learner's devices, and the
learner needs nothing from it but the ``values`` in each trajectory. The flow per batch:

1. a worker sends the batch's tokens and rewards; the critic answers ``values [R]`` (V at the
   position that predicts each response token, as in :mod:`streamrl.learner.critic`) computed
   with its current weights, and its ``version`` (optimizer steps so far) -> the trajectory's
   ``values`` and ``critic_version``;
2. after replying it takes ``critic.epochs`` AdamW steps on that batch: targets are the
   GAE(gamma, lambda) returns from the batch's rewards and its own current values
   (:func:`~streamrl.algorithms.advantages.gae_advantages`), loss ``0.5 (V - G)^2`` per token;
3. every ``critic.checkpoint_every`` steps it saves model + optimizer + step (atomically), and
   a restarted critic resumes from there.

Staleness: values are computed when the batch is produced, by a critic at most one batch
behind; they age with the trajectory, so the policy's ``learner.max_staleness`` bounds theirs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from streamrl.algorithms.advantages import gae_advantages
from streamrl.config import Config
from streamrl.learner.critic import ValueHead, whiten_advantages
from streamrl.learner.packing import response_grid
from streamrl.roles.names import CRITIC

log = logging.getLogger(__name__)
ROLE = CRITIC


def critic_role_configured(cfg: Config) -> bool:
    """Whether the critic runs as its own process (``learner.advantage = gae`` requires it)."""
    return bool(cfg.placement.critic) and cfg.learner.advantage == "gae"


def critic_checkpoint_path(cfg: Config) -> Path:
    """``<checkpoint dir>/critic.safetensors`` (next to the learner's checkpoints)."""
    # Lazy: the checkpoint module pulls in the model stack; the launcher imports this module
    # only for critic_role_configured.
    from streamrl.learner.run_checkpoint import checkpoint_dir  # noqa: PLC0415

    return checkpoint_dir(cfg) / "critic.safetensors"


class ValueModel(torch.nn.Module):
    """A causal LM's trunk (its base model: final hidden states, normed) + a :class:`ValueHead`.

    Shapes: ids, attn [B, T] -> values [B, T] float32.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.trunk = getattr(lm, lm.base_model_prefix)
        self.head = ValueHead(int(lm.config.hidden_size)).to(next(lm.parameters()).dtype)
        self.vocab_size = int(lm.config.vocab_size)

    def forward(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        return self.head(hidden)


def load_value_model(cfg: Config) -> ValueModel:
    """The critic's value model: the trunk of ``critic.path`` or of the initial policy."""
    from streamrl.models.factory import load_model_and_tokenizer  # noqa: PLC0415 (heavy)

    mc = dataclasses.replace(cfg.model, path=cfg.critic.path) if cfg.critic.path else cfg.model
    return ValueModel(load_model_and_tokenizer(mc, cfg.run.seed)[0])


def _padded(fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Right-padded ``ids [B, T]``, ``attn [B, T]`` and the prompt/response lengths."""
    p_lens, r_lens = fields["prompt_lens"].tolist(), fields["response_lens"].tolist()
    width = max(p + r for p, r in zip(p_lens, r_lens))
    ids = torch.zeros(len(p_lens), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    po = ro = 0
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        ids[i, :p] = fields["prompt_tokens"][po:po + p]
        ids[i, p:p + r] = fields["response_tokens"][ro:ro + r]
        attn[i, :p + r] = 1
        po, ro = po + p, ro + r
    return ids, attn, p_lens, r_lens


def _response_grid(values: torch.Tensor, p_lens: list[int], r_lens: list[int]) -> torch.Tensor:
    """``values [B, T]`` -> ``[B, R]``: column j = V at the position predicting response token j."""
    out = values.new_zeros(len(p_lens), max(r_lens))
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        out[i, :r] = values[i, p - 1:p - 1 + r]
    return out


class CriticRole:
    """Scores batches (:meth:`__call__`) and trains on them (:meth:`train_pending`)."""

    def __init__(self, cfg: Config, model: ValueModel, device: str = "cpu", checkpoint: Path | None = None):
        self.cc = cfg.critic
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=self.cc.lr, betas=(0.9, 0.99))
        self.step = 0
        self.checkpoint = checkpoint
        self.pending: list[dict[str, torch.Tensor]] = []
        self.last: dict[str, float] = {}
        if checkpoint is not None and checkpoint.is_file():
            self._load(checkpoint)
            log.info("critic resumed from %s at step %d", checkpoint, self.step)

    def __call__(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """``(values [R] float32, version)``; the batch is kept for training when it has rewards."""
        ids, attn, p_lens, r_lens = _padded(fields)
        with torch.no_grad():
            self.model.eval()
            grid = _response_grid(self.model(ids.to(self.device), attn.to(self.device)).cpu(), p_lens, r_lens)
        if "reward" in fields:
            self.pending.append({k: v.clone() for k, v in fields.items()})
        return torch.cat([grid[i, :r] for i, r in enumerate(r_lens)]), self.step

    def train_pending(self) -> dict[str, float]:
        """``critic.epochs`` steps on each batch scored since the last call; checkpoints on schedule.
        Returns ``critic/*`` metrics of the latest step."""
        while self.pending:
            fields = self.pending.pop(0)
            for _ in range(self.cc.epochs):
                self.last = self._train_step(fields)
                if self.checkpoint is not None and self.step % self.cc.checkpoint_every == 0:
                    self.save()
        return {**self.last, "critic/step": float(self.step)}

    def _train_step(self, fields: dict[str, torch.Tensor]) -> dict[str, float]:
        ids, attn, p_lens, r_lens = _padded(fields)
        self.model.train()
        values = _response_grid(self.model(ids.to(self.device), attn.to(self.device)), p_lens, r_lens)  # [B, R]
        lens = torch.tensor(r_lens)
        adv, ret = gae_advantages(values.detach().cpu(), fields["reward"], lens, self.cc.gamma, self.cc.lam)
        mask = (torch.arange(values.shape[1])[None, :] < lens[:, None]).float()
        n = mask.sum()
        ret, mask_d = ret.to(self.device), mask.to(self.device)
        loss = 0.5 * (((values - ret) ** 2) * mask_d).sum() / n
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.step += 1
        with torch.no_grad():
            v, g = values.detach().cpu(), ret.cpu()
            var_g = float((((g - (g * mask).sum() / n) ** 2) * mask).sum() / n)
            resid = g - v
            var_r = float((((resid - (resid * mask).sum() / n) ** 2) * mask).sum() / n)
        return {"critic/value_loss": float(loss.detach()), "critic/explained_variance":
                1.0 - var_r / var_g if var_g > 1e-12 else 0.0, "critic/value_mean": float((v * mask).sum() / n)}

    def save(self) -> None:
        """Model + AdamW state + step in one safetensors file (tensors only, no pickle), written
        to a temporary file and renamed, so a SIGKILL never leaves a half-written checkpoint."""
        assert self.checkpoint is not None
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        opt = self.optim.state_dict()
        for idx, st in opt["state"].items():
            tensors.update({f"optim.{idx}.{k}": torch.as_tensor(v).cpu().contiguous() for k, v in st.items()})
        meta = {"step": str(self.step), "param_groups": json.dumps(opt["param_groups"])}
        tmp = self.checkpoint.with_suffix(".tmp")
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, self.checkpoint)

    def _load(self, path: Path) -> None:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                _, idx, name = k.split(".", 2)
                state.setdefault(int(idx), {})[name] = v
        self.optim.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
        self.step = int(meta["step"])


def served_gae_advantages(batch, cc, loss_mask: torch.Tensor) -> torch.Tensor:
    """The learner's ``learner.advantage = gae``: ``[B, R]`` GAE advantages on the response grid
    from the batch's ``values`` (the critic role's), whitened over the loss tokens of the batch.

    Args:
        batch: a packed trajectory batch with ``values``; cc: the ``critic`` config section;
        loss_mask: [B, R] response grid of ``response_mask`` (every learner rank holds the
        whole batch, so the statistics need no all-reduce).
    """
    if "values" not in batch.keys():
        raise ValueError("learner.advantage = 'gae' got a batch without values; run the rollout workers with "
                         "the critic role (placement.critic) of the same config")
    adv, _ = gae_advantages(response_grid(batch, "values"), batch["reward"], batch["response_lens"], cc.gamma, cc.lam)
    return whiten_advantages(adv, loss_mask)
