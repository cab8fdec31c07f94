"""Messages between rollout workers and the reward-model role, in the project codec.

A request carries a batch of ``(prompt, response)`` texts; a reply carries one score per pair.
Both are :mod:`streamrl.transport.codec` messages (JSON header + raw buffers, never pickle).
Texts travel as UTF-8 bytes concatenated in one ``uint8`` tensor with ``int64`` offsets, so a
batch of any size is four buffers, not one frame per string::

    request  kind "reward_request", meta {"id": n}
             prompt_bytes [Np] uint8, prompt_offsets [B + 1] int64 (0 .. Np, non-decreasing),
             response_bytes [Nr] uint8, response_offsets [B + 1] int64
    reply    kind "reward_reply", meta {"id": n, "error": null | "why"}, scores [B] float64

Every check on what arrived raises :class:`~streamrl.transport.codec.FrameError` with a short
reason the server counts (``bad_texts``, ``bad_meta`` besides the codec's own).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from streamrl.roles.names import REWARD
from streamrl.transport.codec import FrameError, Limits, decode, encode

REQUEST = "reward_request"
REPLY = "reward_reply"
ENDPOINT = REWARD  # Coordinator endpoint name the reward server publishes
LIMITS = Limits(max_tensors=4, max_ndim=1, dtypes=frozenset({"uint8", "int64", "float64"}),
                max_message_bytes=64 * 1024 * 1024)


def _pack_texts(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bytes [N] uint8, offsets [B + 1] int64)`` of the UTF-8 texts."""
    raw = [t.encode("utf-8") for t in texts]
    offsets = torch.tensor([0] + [len(b) for b in raw], dtype=torch.int64).cumsum(0)
    blob = bytearray(b"".join(raw))
    data = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    return data, offsets


def _unpack_texts(data: torch.Tensor, offsets: torch.Tensor, name: str) -> list[str]:
    if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != data.numel():
        raise FrameError("bad_texts", f"{name} offsets must run from 0 to {data.numel()}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        raise FrameError("bad_texts", f"{name} offsets decrease")
    raw = data.numpy().tobytes()
    bounds = offsets.tolist()
    try:
        return [raw[a:b].decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:])]
    except UnicodeDecodeError as e:
        raise FrameError("bad_texts", f"{name} is not UTF-8 ({e.reason})") from None


def encode_request(request_id: int, prompts: list[str], responses: list[str]) -> list:
    """Frames of one scoring request (``len(prompts) == len(responses)``)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    pb, po = _pack_texts(prompts)
    rb, ro = _pack_texts(responses)
    return encode({"prompt_bytes": pb, "prompt_offsets": po, "response_bytes": rb, "response_offsets": ro},
                  REQUEST, {"id": request_id})


def _request_id(meta: dict[str, Any]) -> int:
    rid = meta.get("id")
    if type(rid) is not int:
        raise FrameError("bad_meta", f"request id {str(rid)[:32]!r} is not an int")
    return rid


def decode_request(frames: Sequence[Any]) -> tuple[int, list[str], list[str]]:
    """``(request_id, prompts [B], responses [B])`` or :class:`FrameError`."""
    _, meta, t = decode(frames, LIMITS, expect_kind=REQUEST)
    rid = _request_id(meta)
    need = {"prompt_bytes": torch.uint8, "prompt_offsets": torch.int64,
            "response_bytes": torch.uint8, "response_offsets": torch.int64}
    for key, dtype in need.items():
        if key not in t or t[key].dtype != dtype:
            raise FrameError("bad_texts", f"{key} missing or not {dtype}")
    prompts = _unpack_texts(t["prompt_bytes"], t["prompt_offsets"], "prompt")
    responses = _unpack_texts(t["response_bytes"], t["response_offsets"], "response")
    if len(prompts) != len(responses):
        raise FrameError("bad_texts", f"{len(prompts)} prompts for {len(responses)} responses")
    return rid, prompts, responses


def encode_reply(request_id: int, scores: list[float] | None, error: str | None = None) -> list:
    """Frames of one reply: the scores, or an error string and no scores."""
    values = torch.tensor(scores or [], dtype=torch.float64)
    return encode({"scores": values}, REPLY, {"id": request_id, "error": error})


def decode_reply(frames: Sequence[Any]) -> tuple[int, list[float], str | None]:
    """``(request_id, scores [B], error)`` or :class:`FrameError`."""
    _, meta, t = decode(frames, LIMITS, expect_kind=REPLY)
    rid = _request_id(meta)
    error = meta.get("error")
    scores = t.get("scores")
    if scores is None or scores.dtype != torch.float64:
        raise FrameError("bad_texts", "reply without float64 scores")
    return rid, scores.tolist(), None if error is None else str(error)
