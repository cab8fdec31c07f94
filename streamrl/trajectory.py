"""The trajectory contract: what a rollout worker sends and the learner trains on.

A *trajectory batch* is one flat :class:`tensordict.TensorDict` (``batch_size=[]``) holding
``B`` trajectories in a **packed ragged layout**: token-level tensors of all trajectories are
concatenated (no padding on the wire), and per-trajectory lengths say where each one ends.

=====================  ==========  ===================  ==========================================
key                    dtype       shape                meaning
=====================  ==========  ===================  ==========================================
prompt_lens            int64       [B]                  prompt tokens of each trajectory
response_lens          int64       [B]                  response tokens of each trajectory
prompt_tokens          int64       [sum(prompt_lens)]   prompt token ids, concatenated
response_tokens        int64       [sum(response_lens)] sampled token ids, concatenated
response_mask          bool        [sum(response_lens)] token takes part in the loss
behaviour_logprobs     float32     [sum(response_lens)] log mu(token) under the sampling policy
policy_version         int64       [sum(response_lens)] weights version that sampled each token
reward                 float32     [B]                  scalar reward of each trajectory
group_id               int64       [B]                  prompt group (group-relative advantages)
traj_id                int64       [B]                  globally unique trajectory id
worker_id              int64       [B]                  producing worker
created_at             float64     [B]                  unix time the trajectory was finished
routed_experts         int16       [sum(resp), L, k]    optional: experts chosen per token/layer
=====================  ==========  ===================  ==========================================

Ids are 63-bit integers: ``(worker_id << 40) | counter`` for trajectories and groups, so
two workers never collide and a worker restarted with a new incarnation counter neither.
"""
from __future__ import annotations

import math

import torch
from tensordict import TensorDict

SCHEMA_VERSION = 1

# key -> (dtype, ndim, length axis: "traj" | "prompt" | "response")
FIELDS: dict[str, tuple[torch.dtype, int, str]] = {
    "prompt_lens": (torch.int64, 1, "traj"),
    "response_lens": (torch.int64, 1, "traj"),
    "prompt_tokens": (torch.int64, 1, "prompt"),
    "response_tokens": (torch.int64, 1, "response"),
    "response_mask": (torch.bool, 1, "response"),
    "behaviour_logprobs": (torch.float32, 1, "response"),
    "policy_version": (torch.int64, 1, "response"),
    "reward": (torch.float32, 1, "traj"),
    "group_id": (torch.int64, 1, "traj"),
    "traj_id": (torch.int64, 1, "traj"),
    "worker_id": (torch.int64, 1, "traj"),
    "created_at": (torch.float64, 1, "traj"),
}
OPTIONAL_FIELDS: dict[str, tuple[torch.dtype, int, str]] = {
    "routed_experts": (torch.int16, 3, "response"),
}
ID_SHIFT = 40


class TrajectoryError(ValueError):
    """A trajectory batch breaks the contract; ``reason`` is a short counter label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def make_id(worker_id: int, counter: int) -> int:
    """A globally unique 63-bit id from a worker id and a per-worker counter."""
    return (int(worker_id) << ID_SHIFT) | (int(counter) & ((1 << ID_SHIFT) - 1))


def validate_trajectories(td: TensorDict, *, max_version: int | None = None) -> None:
    """Check keys, dtypes, shapes, length bookkeeping and finite values.

    Raises :class:`TrajectoryError` whose ``reason`` names the broken rule.
    ``max_version`` rejects tokens claiming a policy version the learner never published.
    """
    keys = set(td.keys())
    missing = [k for k in FIELDS if k not in keys]
    if missing:
        raise TrajectoryError("missing_key", f"missing keys {missing}")
    unknown = [k for k in keys if k not in FIELDS and k not in OPTIONAL_FIELDS]
    if unknown:
        raise TrajectoryError("unknown_key", f"unknown keys {unknown}")
    p_lens, r_lens = td["prompt_lens"], td["response_lens"]
    if p_lens.ndim != 1 or r_lens.ndim != 1:
        raise TrajectoryError("bad_shape", "prompt_lens/response_lens must be 1-D")
    if (p_lens < 1).any() or (r_lens < 1).any():
        raise TrajectoryError("bad_length", "every prompt and response needs >= 1 token")
    n = {"traj": p_lens.numel(), "prompt": int(p_lens.sum()), "response": int(r_lens.sum())}
    if n["traj"] == 0:
        raise TrajectoryError("empty", "a batch holds at least one trajectory")
    for key in keys:
        dtype, ndim, axis = FIELDS.get(key) or OPTIONAL_FIELDS[key]
        t = td[key]
        if t.dtype != dtype:
            raise TrajectoryError("bad_dtype", f"{key} has dtype {t.dtype}, expected {dtype}")
        if t.ndim != ndim or t.shape[0] != n[axis]:
            raise TrajectoryError("bad_shape", f"{key} has shape {tuple(t.shape)}, expected first dim {n[axis]}")
    for key in ("behaviour_logprobs", "reward", "created_at"):
        if not torch.isfinite(td[key]).all():
            raise TrajectoryError("non_finite", f"{key} holds NaN or inf")
    if (td["behaviour_logprobs"] > 1e-4).any():
        raise TrajectoryError("bad_logprob", "behaviour_logprobs must be <= 0")
    if (td["policy_version"] < 0).any():
        raise TrajectoryError("bad_version", "policy_version must be >= 0")
    if max_version is not None and int(td["policy_version"].max()) > max_version:
        raise TrajectoryError("future_version",
                              f"policy_version {int(td['policy_version'].max())} > published {max_version}")


def pack_trajectories(
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]],
    versions: list[list[int]],
    rewards: list[float],
    group_ids: list[int],
    traj_ids: list[int],
    worker_id: int,
    created_at: float,
) -> TensorDict:
    """Build a packed trajectory batch from per-trajectory Python lists."""
    b = len(prompts)
    return TensorDict(
        {
            "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
            "response_lens": torch.tensor([len(r) for r in responses], dtype=torch.int64),
            "prompt_tokens": torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
            "response_tokens": torch.tensor([t for r in responses for t in r], dtype=torch.int64),
            "response_mask": torch.ones(sum(len(r) for r in responses), dtype=torch.bool),
            "behaviour_logprobs": torch.tensor([x for lp in logprobs for x in lp], dtype=torch.float32),
            "policy_version": torch.tensor([v for vs in versions for v in vs], dtype=torch.int64),
            "reward": torch.tensor(rewards, dtype=torch.float32),
            "group_id": torch.tensor(group_ids, dtype=torch.int64),
            "traj_id": torch.tensor(traj_ids, dtype=torch.int64),
            "worker_id": torch.full((b,), worker_id, dtype=torch.int64),
            "created_at": torch.full((b,), created_at, dtype=torch.float64),
        },
        batch_size=[],
    )


def split_trajectories(td: TensorDict) -> list[TensorDict]:
    """Unpack a batch into one packed batch per trajectory (B=1 each)."""
    p_lens, r_lens = td["prompt_lens"].tolist(), td["response_lens"].tolist()
    p_off = [0] + list(_cumsum(p_lens))
    r_off = [0] + list(_cumsum(r_lens))
    out = []
    for i in range(len(p_lens)):
        item = {}
        for key in td.keys():
            _, _, axis = FIELDS.get(key) or OPTIONAL_FIELDS[key]
            t = td[key]
            if axis == "traj":
                item[key] = t[i : i + 1]
            elif axis == "prompt":
                item[key] = t[p_off[i] : p_off[i + 1]]
            else:
                item[key] = t[r_off[i] : r_off[i + 1]]
        out.append(TensorDict(item, batch_size=[]))
    return out


def concat_trajectories(items: list[TensorDict]) -> TensorDict:
    """Concatenate packed batches (inverse of :func:`split_trajectories`)."""
    keys = [k for k in items[0].keys()]
    return TensorDict({k: torch.cat([it[k] for it in items]) for k in keys}, batch_size=[])


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def to_padded(td: TensorDict, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded training tensors from a packed batch.

    Returns:
        input_ids: [B, T] prompt+response tokens, ``pad_id`` after each sequence
        attention_mask: [B, T] 1 on real tokens
        loss_mask: [B, T-1] 1 where position t predicts a response token that takes part in the loss
        behaviour_logprobs: [B, T-1] log mu of the token at t+1 (0 where loss_mask is 0)
        policy_version: [B, T-1] version of the token at t+1 (-1 where loss_mask is 0)
        reward: [B], group_id: [B]
    """
    p_lens, r_lens = td["prompt_lens"].tolist(), td["response_lens"].tolist()
    b = len(p_lens)
    t_max = max(p + r for p, r in zip(p_lens, r_lens))
    input_ids = torch.full((b, t_max), pad_id, dtype=torch.int64)
    attn = torch.zeros((b, t_max), dtype=torch.int64)
    loss_mask = torch.zeros((b, t_max - 1), dtype=torch.float32)
    blp = torch.zeros((b, t_max - 1), dtype=torch.float32)
    ver = torch.full((b, t_max - 1), -1, dtype=torch.int64)
    po = ro = 0
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        input_ids[i, :p] = td["prompt_tokens"][po : po + p]
        input_ids[i, p : p + r] = td["response_tokens"][ro : ro + r]
        attn[i, : p + r] = 1
        # logits at position t predict token t+1: response token j sits at p+j, predicted at p+j-1.
        loss_mask[i, p - 1 : p - 1 + r] = td["response_mask"][ro : ro + r].float()
        blp[i, p - 1 : p - 1 + r] = td["behaviour_logprobs"][ro : ro + r]
        ver[i, p - 1 : p - 1 + r] = td["policy_version"][ro : ro + r]
        po, ro = po + p, ro + r
    return {
        "input_ids": input_ids,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "behaviour_logprobs": blp,
        "policy_version": ver,
        "reward": td["reward"].clone(),
        "group_id": td["group_id"].clone(),
    }


def num_trajectories(td: TensorDict) -> int:
    return int(td["prompt_lens"].numel())


def min_version(td: TensorDict) -> int:
    """Oldest policy version among the response tokens (what staleness is measured on)."""
    return int(td["policy_version"].min()) if td["policy_version"].numel() else math.inf
