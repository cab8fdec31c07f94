"""Wire codec for flat tensor dicts: a JSON header frame plus one raw buffer frame per tensor.

Frame 0 is UTF-8 JSON::

    {"magic": "streamrl", "schema": 1, "kind": "trajectories", "meta": {...},
     "tensors": [{"key": "reward", "dtype": "float32", "shape": [8]}, ...]}

Frames 1..n are the tensors' bytes, in header order, native little-endian, C-contiguous.

Zero-copy both ways: :func:`encode` returns memoryviews over the tensors' own storage (ZeroMQ
sends them with ``copy=False``, so the bytes go from the tensor to the kernel once), and
:func:`decode` wraps the received ZeroMQ frames with ``torch.frombuffer`` (no copy; only a
frame whose address is not aligned for its dtype is copied, which happens for small frames
that libzmq packs into its shared receive buffer).

Nothing from the network is ever unpickled: decoding parses JSON (bounded size, nesting
errors caught), checks every field against :class:`Limits` (frame count, header size, total
size, dtype whitelist, key count/length, ndim, shape vs buffer length) *before* allocating
anything, and only then builds tensor views. Any violation raises :class:`FrameError` with a
short ``reason`` label (``REASONS``) the receiver counts.
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


# Every reason label decode() can raise (the receiver's counters use these names).
REASONS = (
    "empty", "too_many_frames", "oversized", "header_too_large", "bad_header", "bad_magic",
    "bad_schema_version", "bad_kind", "frame_count", "bad_key", "bad_dtype", "bad_shape",
    "duplicate_key", "size_mismatch", "bad_frame",
)


class FrameError(ValueError):
    """A received message violates the wire format; ``reason`` is a short counter label."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Bounds checked before any allocation.

    Attributes:
        max_header_bytes: size of the JSON header frame.
        max_tensors: tensors (keys) per message; the frame count is at most this + 1.
        max_ndim: dimensions per tensor.
        max_message_bytes: all frames together (also libzmq's per-frame MAXMSGSIZE).
        max_key_bytes: length of one key.
        dtypes: dtype names accepted (a subset of ``DTYPES``); ``None`` = all of ``DTYPES``.
    """

    max_header_bytes: int = 64 * 1024
    max_tensors: int = 64
    max_ndim: int = 4
    max_message_bytes: int = 256 * 1024 * 1024
    max_key_bytes: int = 256
    dtypes: frozenset[str] | None = None

    def __post_init__(self):
        for name in ("max_header_bytes", "max_tensors", "max_ndim", "max_message_bytes", "max_key_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.dtypes is not None:
            unknown = set(self.dtypes) - set(DTYPES)
            if unknown:
                raise ValueError(f"Limits.dtypes has unknown dtype names {sorted(unknown)}; known: {sorted(DTYPES)}")
            object.__setattr__(self, "dtypes", frozenset(self.dtypes))

    def allows(self, dtype_name: Any) -> bool:
        return dtype_name in DTYPES and (self.dtypes is None or dtype_name in self.dtypes)


def encode(tensors: dict[str, torch.Tensor], kind: str, meta: dict[str, Any] | None = None) -> list:
    """Encode to a list of frames: ``[header_bytes, memoryview, ...]`` (zero-copy views).

    Tensors are made contiguous on CPU; the returned views keep them alive, so pass the list
    straight to ``socket.send_multipart(frames, copy=False)``.
    """
    entries, bufs = [], []
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise ValueError(f"tensor keys must be flat strings, got {key!r}")
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
    except (ValueError, RecursionError) as e:
        # ValueError covers bad UTF-8, bad JSON and over-long integer literals;
        # RecursionError covers deeply nested arrays inside the (bounded) header.
        raise FrameError("bad_header", f"header is not valid JSON: {type(e).__name__}: {str(e)[:80]}") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise FrameError("bad_magic", "header lacks the streamrl magic")
    if type(header.get("schema")) is not int or header["schema"] != WIRE_VERSION:
        raise FrameError("bad_schema_version", f"wire schema {str(header.get('schema'))[:32]!r} != {WIRE_VERSION}")
    kind, meta, entries = header.get("kind"), header.get("meta"), header.get("tensors")
    if not isinstance(kind, str) or (expect_kind is not None and kind != expect_kind):
        raise FrameError("bad_kind", f"kind {str(kind)[:32]!r}, expected {expect_kind!r}")
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
        out[key] = _tensor_view(buf, dtype, shape)
    return kind, meta, out


def _tensor_view(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over ``buf`` (sizes already checked): a view, or a copy if misaligned or empty."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    itemsize = _itemsize(dtype)
    if t.data_ptr() % itemsize:
        # libzmq hands out small frames at arbitrary offsets of its batch buffer; unaligned
        # loads are legal on x86 but not on every platform/kernel, and such frames are small.
        t = t.clone()
    return t.view(dtype).view(shape)


def _check_entry(entry: Any, limits: Limits) -> tuple[str, torch.dtype, list[int]]:
    if not isinstance(entry, dict):
        raise FrameError("bad_header", "tensor entry must be an object")
    key, dtype, shape = entry.get("key"), entry.get("dtype"), entry.get("shape")
    if not isinstance(key, str) or not key or len(key) > limits.max_key_bytes:
        raise FrameError("bad_key", f"key {str(key)[:64]!r}")
    if not isinstance(dtype, str) or not limits.allows(dtype):
        raise FrameError("bad_dtype", f"{key}: dtype {str(dtype)[:32]!r} not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_ndim
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40 for s in shape)
    ):
        raise FrameError("bad_shape", f"{key}: shape {str(shape)[:64]}")
    return key, DTYPES[dtype], shape


_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPES.values()}


def _itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZE[dtype]


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray)):
        return memoryview(frame)
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is None:
        raise FrameError("bad_frame", f"unsupported frame type {type(frame).__name__}")
    return buf
