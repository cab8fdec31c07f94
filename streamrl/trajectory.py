"""The trajectory contract: what a rollout worker sends and the learner trains on.

A *trajectory batch* is one flat :class:`tensordict.TensorDict` (``batch_size=[]``) holding
``B`` trajectories in a **packed ragged layout**: token-level tensors of all trajectories are
concatenated (no padding on the wire), and per-trajectory lengths say where each one ends.
Trajectory ``i`` owns response rows ``sum(response_lens[:i]) : sum(response_lens[:i+1])`` of
every ``response`` tensor (and likewise for prompts). Why packed: a batch of 64 responses of
20..2000 tokens padded to 2000 would ship ~2x the bytes; packed, the wire carries only real
tokens and the learner pads once (:func:`to_padded`).

Required keys (``FIELDS``):

=====================  ==========  =====================  ========================================
key                    dtype       shape                  meaning
=====================  ==========  =====================  ========================================
prompt_lens            int64       [B]                    prompt tokens of each trajectory (>= 1)
response_lens          int64       [B]                    response tokens of each trajectory (>= 1)
prompt_tokens          int64       [P = sum(prompt_lens)] prompt token ids, concatenated
response_tokens        int64       [R = sum(resp_lens)]   sampled token ids, concatenated
response_mask          bool        [R]                    token takes part in the loss
behaviour_logprobs     float32     [R]                    log mu(token) under the sampling policy
policy_version         int64       [R]                    weights version that sampled each token
reward                 float32     [B]                    scalar reward of each trajectory
group_id               int64       [B]                    prompt group (group-relative advantages)
traj_id                int64       [B]                    globally unique trajectory id
worker_id              int64       [B]                    producing worker
created_at             float64     [B]                    unix time the trajectory was finished
=====================  ==========  =====================  ========================================

Optional keys (``OPTIONAL_FIELDS``; present for the whole batch or absent):

=====================  ==========  =====================  ========================================
started_at             float64     [B]                    unix time generation started (<= created_at)
reward_components      float32     [B, C]                 per-criterion rewards (``reward`` is their
                                                          combination); C >= 1
routed_experts         int16       [R, L, k]              expert ids the router chose, per MoE
                                                          layer, at the position that *predicted*
                                                          each response token (input position
                                                          p+j-1 for token j): routing replay;
                                                          L layers, top-k
token_rewards          float32     [R]                    reward credited to each response token
                                                          (``rollout.token_rewards``); sums to
                                                          ``reward`` per trajectory
ref_logprobs           float32     [R]                    log pi_ref(token) from the reference role
                                                          (``placement.reference``); the KL term
values                 float32     [R]                    V at the position predicting each token,
                                                          from the critic role (``placement.critic``)
critic_version         int64       [B]                    critic optimizer steps behind ``values``
=====================  ==========  =====================  ========================================

``policy_version`` is per token because weights can change in the middle of a generation
(in-flight updates); staleness is measured on the oldest token (:func:`min_version`).
The wire adds per-message metadata outside the tensors (sender session, sequence number,
``sent_at``); see :mod:`streamrl.transport.channel`.

Naming: keys are flat so the codec and ``torch.distributed`` broadcast stay trivial.
``TORCHRL_KEYS`` maps them to the nested keys of ``torchrl.modules.llm``
(``("tokens", "response")``, ``("log_probs", "response")``, ...) for code that wants them.

Ids are 63-bit integers ``(worker_id << 40) | (incarnation << 28) | counter`` for trajectories
and groups (:func:`make_id`, :func:`split_id`; the one definition of the layout), so two workers
never collide and a worker restarted with a new incarnation neither.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

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
    "started_at": (torch.float64, 1, "traj"),
    "reward_components": (torch.float32, 2, "traj"),
    "routed_experts": (torch.int16, 3, "response"),
    "token_rewards": (torch.float32, 1, "response"),
    "ref_logprobs": (torch.float32, 1, "response"),
    "values": (torch.float32, 1, "response"),
    "critic_version": (torch.int64, 1, "traj"),
}
ALL_FIELDS = {**FIELDS, **OPTIONAL_FIELDS}
TORCHRL_KEYS: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("tokens", "prompt"),
    "response_tokens": ("tokens", "response"),
    "behaviour_logprobs": ("log_probs", "response"),
    "response_mask": ("masks", "response"),
    "reward": ("next", "reward"),
}
ID_SHIFT = 40  # bits below the worker id
INCARNATION_BITS = 28  # bits of the per-incarnation counter, below the incarnation
MAX_EXPERT_ID = torch.iinfo(torch.int16).max


class TrajectoryError(ValueError):
    """A trajectory batch breaks the contract; ``reason`` is a short counter label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def make_id(worker_id: int, counter: int, incarnation: int = 0) -> int:
    """A globally unique 63-bit id from a worker id, its incarnation and a per-incarnation counter
    (``counter < 2**INCARNATION_BITS`` when ``incarnation`` is given)."""
    low = (int(incarnation) << INCARNATION_BITS) | int(counter)
    return (int(worker_id) << ID_SHIFT) | (low & ((1 << ID_SHIFT) - 1))


def split_id(tid: int) -> tuple[int, int, int]:
    """``(worker_id, incarnation, counter)`` of an id made by :func:`make_id`."""
    low = int(tid) & ((1 << ID_SHIFT) - 1)
    return int(tid) >> ID_SHIFT, low >> INCARNATION_BITS, low & ((1 << INCARNATION_BITS) - 1)


def validate_trajectories(td: TensorDict | Mapping[str, torch.Tensor], *, max_version: int | None = None) -> None:
    """Check keys, dtypes, shapes, length bookkeeping, ids and finite values.

    ``td`` is a TensorDict or a plain ``{key: tensor}`` dict (the receiver validates the
    decoded dict before paying for a TensorDict).

    Cheap checks (keys, dtypes, shapes) run before any pass over token data.
    Raises :class:`TrajectoryError` whose ``reason`` names the broken rule.
    ``max_version`` rejects tokens claiming a policy version the learner never published.
    """
    keys = set(td.keys())
    missing = [k for k in FIELDS if k not in keys]
    if missing:
        raise TrajectoryError("missing_key", f"missing keys {missing}")
    unknown = [k for k in keys if k not in ALL_FIELDS]
    if unknown:
        raise TrajectoryError("unknown_key", f"unknown keys {sorted(map(str, unknown))}")
    p_lens, r_lens = td["prompt_lens"], td["response_lens"]
    for name, t in (("prompt_lens", p_lens), ("response_lens", r_lens)):
        if t.dtype != torch.int64 or t.ndim != 1:
            raise TrajectoryError("bad_shape", f"{name} must be 1-D int64, got {t.dtype} {tuple(t.shape)}")
    if p_lens.numel() == 0:
        raise TrajectoryError("empty", "a batch holds at least one trajectory")
    if p_lens.shape != r_lens.shape:
        raise TrajectoryError("bad_shape", f"prompt_lens {tuple(p_lens.shape)} != response_lens {tuple(r_lens.shape)}")
    if (p_lens < 1).any() or (r_lens < 1).any():
        raise TrajectoryError("bad_length", "every prompt and response needs >= 1 token")
    # A bogus huge length would fail the shape check anyway; capping it keeps the int64 sums
    # from wrapping around for any batch that fits in one message (B < 2**25).
    if (p_lens > 2**31).any() or (r_lens > 2**31).any():
        raise TrajectoryError("bad_length", "a length exceeds 2**31 tokens")
    n = {"traj": p_lens.numel(), "prompt": int(p_lens.sum()), "response": int(r_lens.sum())}
    for key in keys:
        dtype, ndim, axis = ALL_FIELDS[key]
        t = td[key]
        if t.dtype != dtype:
            raise TrajectoryError("bad_dtype", f"{key} has dtype {t.dtype}, expected {dtype}")
        if t.ndim != ndim or t.shape[0] != n[axis] or any(d < 1 for d in t.shape[1:]):
            raise TrajectoryError("bad_shape", f"{key} has shape {tuple(t.shape)}, expected {ndim}-D "
                                  f"with first dim {n[axis]} and trailing dims >= 1")
    # Value checks: one min/max pass per tensor (NaN propagates through aminmax, so a
    # non-finite min or max catches NaN and +-inf) instead of a boolean temporary per rule.
    for key in ("behaviour_logprobs", "reward", "created_at", "started_at", "reward_components", "token_rewards",
                "ref_logprobs", "values"):
        if key in keys:
            lo, hi = _minmax(td[key])
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise TrajectoryError("non_finite", f"{key} holds NaN or inf")
            if key in ("behaviour_logprobs", "ref_logprobs") and hi > 1e-4:
                raise TrajectoryError("bad_logprob", f"{key} must be <= 0, max is {hi}")
    lo, hi = _minmax(td["policy_version"])
    if lo < 0:
        raise TrajectoryError("bad_version", f"policy_version must be >= 0, min is {lo}")
    if max_version is not None and hi > max_version:
        raise TrajectoryError("future_version", f"policy_version {hi} > published {max_version}")
    for key in ("traj_id", "group_id", "worker_id", "routed_experts", "critic_version"):
        if key in keys and _minmax(td[key])[0] < 0:
            raise TrajectoryError("bad_id" if key != "routed_experts" else "bad_expert", f"{key} must be >= 0")
    if "started_at" in keys and (td["started_at"] > td["created_at"]).any():
        raise TrajectoryError("bad_timestamp", "started_at is later than created_at")


def _minmax(t: torch.Tensor) -> tuple[float, float]:
    # numpy's reductions are single-threaded SIMD loops: torch's would fan out to the
    # intra-op thread pool, which on a busy learner host costs milliseconds in contention.
    if t.device.type == "cpu" and t.dtype != torch.bfloat16:
        a = t.detach().numpy()
        return a.min().item(), a.max().item()
    lo, hi = torch.aminmax(t)
    return lo.item(), hi.item()


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
    *,
    started_at: float | list[float] | None = None,
    response_masks: list[list[bool]] | None = None,
    reward_components: list[list[float]] | None = None,
    routed_experts: list[torch.Tensor] | None = None,
    token_rewards: list[list[float]] | None = None,
) -> TensorDict:
    """Build a packed trajectory batch from per-trajectory Python lists.

    Optional fields are added when given: ``started_at`` (one time for all or one per
    trajectory), ``response_masks`` (default all True), ``reward_components`` ([B][C]) and
    ``routed_experts`` (one int tensor ``[len(response_i), L, k]`` per trajectory) and
    ``token_rewards`` (one list of ``len(response_i)`` floats per trajectory).
    """
    b = len(prompts)
    n_resp = sum(len(r) for r in responses)
    out = {
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        "response_lens": torch.tensor([len(r) for r in responses], dtype=torch.int64),
        "prompt_tokens": torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
        "response_tokens": torch.tensor([t for r in responses for t in r], dtype=torch.int64),
        "response_mask": (torch.tensor([m for ms in response_masks for m in ms], dtype=torch.bool)
                          if response_masks is not None else torch.ones(n_resp, dtype=torch.bool)),
        "behaviour_logprobs": torch.tensor([x for lp in logprobs for x in lp], dtype=torch.float32),
        "policy_version": torch.tensor([v for vs in versions for v in vs], dtype=torch.int64),
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "group_id": torch.tensor(group_ids, dtype=torch.int64),
        "traj_id": torch.tensor(traj_ids, dtype=torch.int64),
        "worker_id": torch.full((b,), worker_id, dtype=torch.int64),
        "created_at": torch.full((b,), created_at, dtype=torch.float64),
    }
    if started_at is not None:
        out["started_at"] = (torch.full((b,), started_at, dtype=torch.float64) if isinstance(started_at, (int, float))
                             else torch.tensor(started_at, dtype=torch.float64))
    if reward_components is not None:
        out["reward_components"] = torch.tensor(reward_components, dtype=torch.float32).reshape(b, -1)
    if routed_experts is not None:
        out["routed_experts"] = torch.cat([torch.as_tensor(r).to(torch.int16) for r in routed_experts])
    if token_rewards is not None:
        out["token_rewards"] = torch.tensor([x for tr in token_rewards for x in tr], dtype=torch.float32)
    return TensorDict(out, batch_size=[])


def split_trajectories(td: TensorDict) -> list[TensorDict]:
    """Unpack a batch into one packed batch per trajectory (B=1 each)."""
    p_lens, r_lens = td["prompt_lens"].tolist(), td["response_lens"].tolist()
    p_off = [0] + list(_cumsum(p_lens))
    r_off = [0] + list(_cumsum(r_lens))
    out = []
    for i in range(len(p_lens)):
        item = {}
        for key in td.keys():
            _, _, axis = ALL_FIELDS[key]
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
    """Concatenate packed batches (inverse of :func:`split_trajectories`).

    Optional keys are kept only when every item has them (an optional field describes the
    whole batch or nothing), so batches from workers with and without routing replay mix.
    """
    if not items:
        raise ValueError("concat_trajectories needs at least one batch, got 0")
    keys = [k for k in items[0].keys() if all(k in it.keys() for it in items)]
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
        routed_experts: [B, T-1, L, k] int64 experts of the token at t+1 (-1 elsewhere);
            only when the batch carries ``routed_experts``
        token_rewards: [B, T-1] float32 reward credited to the token at t+1 (0 elsewhere);
            only when the batch carries ``token_rewards``
        response_positions: [B, T-1] bool, True where t predicts a response token (whether
            or not it is in the loss); only with ``token_rewards``
    """
    p_lens, r_lens = td["prompt_lens"].tolist(), td["response_lens"].tolist()
    b = len(p_lens)
    t_max = max(p + r for p, r in zip(p_lens, r_lens))
    input_ids = torch.full((b, t_max), pad_id, dtype=torch.int64)
    attn = torch.zeros((b, t_max), dtype=torch.int64)
    po = ro = 0
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        input_ids[i, :p] = td["prompt_tokens"][po : po + p]
        input_ids[i, p : p + r] = td["response_tokens"][ro : ro + r]
        attn[i, : p + r] = 1
        po, ro = po + p, ro + r

    def shifted(values: torch.Tensor, fill, dtype: torch.dtype) -> torch.Tensor:
        return _at_predicting_positions(values, p_lens, r_lens, t_max, fill, dtype)

    out = {
        "input_ids": input_ids,
        "attention_mask": attn,
        "loss_mask": shifted(td["response_mask"], 0, torch.float32),
        "behaviour_logprobs": shifted(td["behaviour_logprobs"], 0, torch.float32),
        "policy_version": shifted(td["policy_version"], -1, torch.int64),
        "reward": td["reward"].clone(),
        "group_id": td["group_id"].clone(),
    }
    routed = td.get("routed_experts", None)
    if routed is not None:
        out["routed_experts"] = shifted(routed, -1, torch.int64)
    tok_r = td.get("token_rewards", None)
    if tok_r is not None:
        out["token_rewards"] = shifted(tok_r, 0, torch.float32)
        out["response_positions"] = shifted(torch.ones(tok_r.shape[0], dtype=torch.bool), False, torch.bool)
    return out


def _at_predicting_positions(values: torch.Tensor, p_lens: list[int], r_lens: list[int], t_max: int, fill,
                             dtype: torch.dtype) -> torch.Tensor:
    """Per-response-token ``values`` [sum(r_lens), *rest] laid out as [B, t_max - 1, *rest]:
    logits at position t predict token t+1, so response token j of row i (at p_i + j) lands at
    p_i + j - 1; ``fill`` elsewhere."""
    out = torch.full((len(p_lens), t_max - 1, *values.shape[1:]), fill, dtype=dtype)
    ro = 0
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        out[i, p - 1 : p - 1 + r] = values[ro : ro + r]
        ro += r
    return out


def num_trajectories(td: TensorDict) -> int:
    return int(td["prompt_lens"].numel())


def min_version(td: TensorDict) -> int:
    """Oldest policy version among the response tokens (what staleness is measured on)."""
    return int(td["policy_version"].min()) if td["policy_version"].numel() else math.inf
