"""Messages between rollout workers and the token-scoring roles (reference, critic).

A request carries a batch's token ids in the trajectory's packed ragged layout (see
:mod:`streamrl.trajectory`); the reply carries one float per response token, in the same
order. Both are :mod:`streamrl.transport.codec` messages (JSON header + raw buffers, never
pickle)::

    request  kind "<role>_request", meta {"id": n}
             prompt_lens [B] int64, response_lens [B] int64 (each >= 1),
             prompt_tokens [P = sum(prompt_lens)] int64, response_tokens [R] int64,
             optional reward [B] float32 (the critic trains on it)
    reply    kind "<role>_reply", meta {"id": n, "error": null | "why", "version": int},
             values [R] float32 (reference: log-probs; critic: V at each response token)

Every check on what arrived raises :class:`~streamrl.transport.codec.FrameError` with a short
reason the server counts (``bad_tokens``, ``bad_meta`` besides the codec's own).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from streamrl.transport.codec import FrameError, Limits, decode, encode

LIMITS = Limits(max_tensors=5, max_ndim=1, dtypes=frozenset({"int64", "float32"}),
                max_message_bytes=128 * 1024 * 1024)
TOKEN_KEYS = ("prompt_lens", "response_lens", "prompt_tokens", "response_tokens")


def encode_request(role: str, request_id: int, fields: dict[str, torch.Tensor]) -> list:
    """Frames of one request: the four ``TOKEN_KEYS`` of a packed batch (and ``reward``, if given)."""
    tensors = {k: fields[k].to(torch.int64).contiguous() for k in TOKEN_KEYS}
    if "reward" in fields:
        tensors["reward"] = fields["reward"].to(torch.float32).contiguous()
    return encode(tensors, f"{role}_request", {"id": request_id})


def _request_id(meta: dict[str, Any]) -> int:
    rid = meta.get("id")
    if type(rid) is not int:
        raise FrameError("bad_meta", f"request id {str(rid)[:32]!r} is not an int")
    return rid


def decode_request(role: str, frames: Sequence[Any], vocab_size: int) -> tuple[int, dict[str, torch.Tensor]]:
    """``(request_id, {key: tensor})`` of a well-formed request, or :class:`FrameError`
    (lengths that do not add up, token ids outside ``[0, vocab_size)``, a wrong dtype)."""
    _, meta, t = decode(frames, LIMITS, expect_kind=f"{role}_request")
    rid = _request_id(meta)
    for key in TOKEN_KEYS:
        if key not in t or t[key].dtype != torch.int64:
            raise FrameError("bad_tokens", f"{key} missing or not int64")
    p_lens, r_lens = t["prompt_lens"], t["response_lens"]
    if p_lens.numel() == 0 or p_lens.shape != r_lens.shape:
        raise FrameError("bad_tokens", f"prompt_lens {tuple(p_lens.shape)} / response_lens {tuple(r_lens.shape)}")
    if int(p_lens.min()) < 1 or int(r_lens.min()) < 1:
        raise FrameError("bad_tokens", "every prompt and response needs >= 1 token")
    if int(p_lens.sum()) != t["prompt_tokens"].numel() or int(r_lens.sum()) != t["response_tokens"].numel():
        raise FrameError("bad_tokens", "lengths do not add up to the token counts")
    for key in ("prompt_tokens", "response_tokens"):
        if t[key].numel() and (int(t[key].min()) < 0 or int(t[key].max()) >= vocab_size):
            raise FrameError("bad_tokens", f"{key} outside [0, {vocab_size})")
    if "reward" in t:
        r = t["reward"]
        if r.dtype != torch.float32 or r.shape != p_lens.shape or not bool(torch.isfinite(r).all()):
            raise FrameError("bad_tokens", "reward must be finite float32 [B]")
    return rid, dict(t)


def encode_reply(role: str, request_id: int, values: torch.Tensor | None, error: str | None = None,
                 version: int = 0) -> list:
    """Frames of one reply: ``values [R]``, or an error string and no values."""
    v = values.to(torch.float32).contiguous() if values is not None else torch.zeros(0)
    return encode({"values": v}, f"{role}_reply", {"id": request_id, "error": error, "version": int(version)})


def decode_reply(role: str, frames: Sequence[Any]) -> tuple[int, torch.Tensor, str | None, int]:
    """``(request_id, values [R], error, version)`` or :class:`FrameError`."""
    _, meta, t = decode(frames, LIMITS, expect_kind=f"{role}_reply")
    rid = _request_id(meta)
    values = t.get("values")
    version = meta.get("version", 0)
    if values is None or values.dtype != torch.float32 or type(version) is not int:
        raise FrameError("bad_meta", "reply without float32 values or an int version")
    error = meta.get("error")
    return rid, values.clone(), None if error is None else str(error), version
