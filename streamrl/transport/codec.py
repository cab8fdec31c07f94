"""Wire codec for flat tensor dicts: a JSON header frame plus one raw buffer frame per tensor.

Frame 0 is UTF-8 JSON::

    {"magic": "streamrl", "schema": 1, "kind": "trajectories", "meta": {...},
     "tensors": [{"key": "reward", "dtype": "float32", "shape": [8]}, ...]}

Frames 1..n are the tensors' bytes, in header order, native little-endian, C-contiguous.

Nothing from the network is ever unpickled: decoding parses JSON, checks every field against
:class:`Limits` (frame count, sizes, dtype whitelist, shapes) *before* allocating, and then
wraps the received buffers with ``torch.frombuffer`` (zero-copy). Any violation raises
:class:`FrameError` with a short ``reason`` label the receiver counts.
"""
from __future__ import annotations

import json
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

MAGIC = "streamrl"
WIRE_VERSION = 1

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Received zmq buffers are read-only; decoded tensors are documented as read-only views.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise RuntimeError("the StreamRL wire format assumes a little-endian host")


class FrameError(ValueError):
    """A received message violates the wire format; ``reason`` is a short counter label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Bounds checked before any allocation."""

    max_header_bytes: int = 64 * 1024
    max_tensors: int = 64
    max_ndim: int = 4
    max_message_bytes: int = 256 * 1024 * 1024


def encode(tensors: dict[str, torch.Tensor], kind: str, meta: dict[str, Any] | None = None) -> list:
    """Encode to a list of frames: ``[header_bytes, memoryview, ...]`` (zero-copy views).

    Tensors are made contiguous on CPU; the returned views keep them alive, so pass the list
    straight to ``socket.send_multipart(frames, copy=False)``.
    """
    entries, bufs = [], []
    for key, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {key!r} has unsupported dtype {t.dtype}")
        t = t.detach().to("cpu").contiguous()
        entries.append({"key": key, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
        bufs.append(_as_bytes_view(t))
    header = {"magic": MAGIC, "schema": WIRE_VERSION, "kind": kind, "meta": meta or {}, "tensors": entries}
    return [json.dumps(header, separators=(",", ":")).encode()] + bufs


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    # Reinterpret as bytes without copying; numpy lacks bfloat16, so go through uint8.
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def decode(frames: Sequence[Any], limits: Limits = Limits(), expect_kind: str | None = None):
    """Decode frames into ``(kind, meta, {key: tensor})`` or raise :class:`FrameError`.

    ``frames`` may be ``bytes`` or ``zmq.Frame`` objects (their ``.buffer`` is used, no copy).
    Returned tensors alias the received buffers (read-only memory: clone before writing).
    """
    if not frames:
        raise FrameError("empty", "no frames")
    if len(frames) > limits.max_tensors + 1:
        raise FrameError("too_many_frames", f"{len(frames)} frames > {limits.max_tensors + 1}")
    bufs = [_buffer(f) for f in frames]
    total = sum(len(b) for b in bufs)
    if total > limits.max_message_bytes:
        raise FrameError("oversized", f"{total} bytes > {limits.max_message_bytes}")
    head = bufs[0]
    if len(head) > limits.max_header_bytes:
        raise FrameError("header_too_large", f"{len(head)} bytes")
    try:
        header = json.loads(bytes(head).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError("bad_header", f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise FrameError("bad_magic", "header lacks the streamrl magic")
    if header.get("schema") != WIRE_VERSION:
        raise FrameError("bad_schema_version", f"wire schema {header.get('schema')!r} != {WIRE_VERSION}")
    kind, meta, entries = header.get("kind"), header.get("meta"), header.get("tensors")
    if not isinstance(kind, str) or (expect_kind is not None and kind != expect_kind):
        raise FrameError("bad_kind", f"kind {kind!r}, expected {expect_kind!r}")
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise FrameError("bad_header", "meta must be an object and tensors a list")
    if len(entries) != len(bufs) - 1:
        raise FrameError("frame_count", f"header lists {len(entries)} tensors, got {len(bufs) - 1} frames")
    out: dict[str, torch.Tensor] = {}
    for entry, buf in zip(entries, bufs[1:]):
        key, dtype, shape = _check_entry(entry, limits)
        if key in out:
            raise FrameError("duplicate_key", f"key {key!r} twice")
        nbytes = math.prod(shape) * _itemsize(dtype)
        if nbytes != len(buf):
            raise FrameError("size_mismatch", f"{key}: header says {nbytes} bytes, frame has {len(buf)}")
        if nbytes == 0:
            out[key] = torch.empty(shape, dtype=dtype)
        else:
            out[key] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    return kind, meta, out


def _check_entry(entry: Any, limits: Limits) -> tuple[str, torch.dtype, list[int]]:
    if not isinstance(entry, dict):
        raise FrameError("bad_header", "tensor entry must be an object")
    key, dtype, shape = entry.get("key"), entry.get("dtype"), entry.get("shape")
    if not isinstance(key, str) or not key or len(key) > 256:
        raise FrameError("bad_key", f"key {key!r}")
    if dtype not in DTYPES:
        raise FrameError("bad_dtype", f"{key}: dtype {dtype!r} not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_ndim
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40 for s in shape)
    ):
        raise FrameError("bad_shape", f"{key}: shape {shape!r}")
    return key, DTYPES[dtype], shape


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is None:
        raise FrameError("bad_frame", f"unsupported frame type {type(frame).__name__}")
    return buf
