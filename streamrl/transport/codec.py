"""Wire codec for flat tensor dicts: a JSON header frame plus raw tensor buffers as frames.

Frame 0 is UTF-8 JSON::

    {"magic": "streamrl", "schema": 2, "kind": "trajectories", "meta": {...}, "pack_below": 65536,
     "tensors": [{"key": "reward", "dtype": "float32", "shape": [8]}, ...]}

Tensor bytes are native little-endian, C-contiguous. The layout follows from the header
alone (nothing to trust twice): frame 1 packs, in header order and at 8-byte aligned offsets,
every tensor smaller than ``pack_below`` bytes; frames 2.. hold each larger tensor, one
frame each, in header order. Why pack: a trajectory batch has a dozen tensors of which most
are ``[B]``-sized; a ZeroMQ frame costs tens of microseconds each way, a memcpy of a few KB
nothing, and pyzmq copies frames below 64 KB anyway.

Zero-copy both ways for the large tensors: :func:`encode` returns memoryviews over the
tensors' own storage (sent with ``copy=False``: the bytes go from the tensor to the kernel
once), and :func:`decode` wraps received ZeroMQ frames with ``torch.frombuffer`` (no copy;
only a buffer not aligned for its dtype is copied, which happens for small frames that
libzmq places inside its shared receive buffer).

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
WIRE_VERSION = 2
PACK_BELOW = 64 * 1024  # tensors smaller than this share frame 1 (copied); larger ones go zero-copy

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
    """Encode to frames ``[header, packed_small, big_view, ...]`` (large tensors zero-copy).

    Tensors are made contiguous on CPU; the returned views keep them alive, so pass the list
    straight to ``socket.send_multipart(frames, copy=False)`` and do not modify the tensors
    until ZeroMQ has sent them.
    """
    entries, small, big = [], [], []
    offset = 0
    for key, t in tensors.items():
        if not isinstance(key, str):
            raise ValueError(f"tensor keys must be flat strings, got {key!r}")
        name = DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise ValueError(f"tensor {key!r} has unsupported dtype {t.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.detach().to("cpu").contiguous()
        entries.append({"key": key, "dtype": name, "shape": list(t.shape)})
        view = _as_bytes_view(t)
        if view.nbytes < PACK_BELOW:
            pad = -offset % 8
            if pad:
                small.append(bytes(pad))
            small.append(view)
            offset += pad + view.nbytes
        else:
            big.append(view)
    header = {"magic": MAGIC, "schema": WIRE_VERSION, "kind": kind, "meta": meta or {},
              "pack_below": PACK_BELOW, "tensors": entries}
    return [json.dumps(header, separators=(",", ":")).encode(), b"".join(small)] + big


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without copying (``t`` is a contiguous CPU tensor)."""
    if t.numel() == 0:
        return memoryview(b"")
    if t.requires_grad:
        t = t.detach()
    if t.ndim == 0:
        t = t.reshape(1)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: same bytes as int16
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def decode(frames: Sequence[Any], limits: Limits = Limits(), expect_kind: str | None = None):
    """Decode frames into ``(kind, meta, {key: tensor})`` or raise :class:`FrameError`.

    ``frames`` may be ``bytes``/buffers or ``zmq.Frame`` objects (their ``.buffer`` is used,
    no copy). Returned tensors alias the received buffers (do not write to them).
    """
    if not frames:
        raise FrameError("empty", "no frames")
    if len(frames) > limits.max_tensors + 2:
        raise FrameError("too_many_frames", f"{len(frames)} frames > {limits.max_tensors + 2}")
    bufs = [_buffer(f) for f in frames]
    total = sum(len(b) for b in bufs)
    if total > limits.max_message_bytes:
        raise FrameError("oversized", f"{total} bytes > {limits.max_message_bytes}")
    kind, meta, entries, pack_below = _parse_header(bufs[0], limits, expect_kind)
    layout = _plan_layout(entries, pack_below, limits, bufs)
    # Views (or small aligned copies) over the received buffers.
    out: dict[str, torch.Tensor] = {}
    for key, dtype, shape, frame, start, nbytes in layout:
        out[key] = _tensor_view(bufs[frame][start:start + nbytes], dtype, shape)
    return kind, meta, out


def _parse_header(head: memoryview, limits: Limits, expect_kind: str | None) -> tuple[str, dict, list, int]:
    """Frame 0 checked against ``limits``: ``(kind, meta, tensor entries, pack_below)``."""
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
    pack_below = header.get("pack_below")
    if not isinstance(meta, dict) or not isinstance(entries, list) or type(pack_below) is not int or pack_below < 0:
        raise FrameError("bad_header", "meta must be an object, tensors a list, pack_below an int >= 0")
    if len(entries) > limits.max_tensors:
        raise FrameError("too_many_frames", f"{len(entries)} tensors > {limits.max_tensors}")
    return kind, meta, entries, pack_below


def _plan_layout(entries: list, pack_below: int, limits: Limits, bufs: list[memoryview]) -> list[tuple]:
    """Check every entry and where its bytes lie, touching no payload byte: ``[(key, dtype,
    shape, frame, start, nbytes)]`` in header order, consistent with the frames received."""
    layout, seen = [], set()
    small_end, n_big = 0, 0
    for entry in entries:
        key, dtype, shape = _check_entry(entry, limits)
        if key in seen:
            raise FrameError("duplicate_key", f"key {key[:64]!r} twice")
        seen.add(key)
        nbytes = math.prod(shape) * _itemsize(dtype)
        if nbytes > limits.max_message_bytes:
            raise FrameError("size_mismatch", f"{key[:64]}: {nbytes} bytes cannot fit the message")
        if nbytes < pack_below:
            start = small_end + (-small_end % 8)
            layout.append((key, dtype, shape, 1, start, nbytes))
            small_end = start + nbytes
        else:
            n_big += 1
            layout.append((key, dtype, shape, 1 + n_big, 0, nbytes))
    if len(bufs) != 2 + n_big:
        raise FrameError("frame_count", f"header implies {2 + n_big} frames, got {len(bufs)}")
    if len(bufs[1]) != small_end:
        raise FrameError("size_mismatch", f"packed frame has {len(bufs[1])} bytes, header implies {small_end}")
    for key, _, _, frame, _, nbytes in layout:
        if frame > 1 and len(bufs[frame]) != nbytes:
            raise FrameError("size_mismatch", f"{key[:64]}: header says {nbytes} bytes, frame has {len(bufs[frame])}")
    return layout


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
    if not isinstance(key, str) or not key or len(key.encode("utf-8", "replace")) > limits.max_key_bytes:
        raise FrameError("bad_key", f"key {str(key)[:64]!r}")
    if not isinstance(dtype, str) or not limits.allows(dtype):
        raise FrameError("bad_dtype", f"{key[:64]}: dtype {str(dtype)[:32]!r} not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > limits.max_ndim
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**40 for s in shape)
    ):
        raise FrameError("bad_shape", f"{key[:64]}: shape {str(shape)[:64]}")
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
