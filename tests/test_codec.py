"""Wire codec: round trips for every dtype (in memory and over real ZeroMQ), zero copy, limits."""
from __future__ import annotations

import json

import pytest
import torch
import zmq

from streamrl.transport.codec import DTYPES, REASONS, FrameError, Limits, decode, encode
from streamrl.transport.sockets import learner_socket, recv_bounded, worker_socket


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


SHAPES = [(), (0,), (1,), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2)]


def roundtrip_bytes(tensors, limits=Limits()):
    frames = [bytes(f) for f in encode(tensors, "t", {"k": 1})]
    return decode(frames, limits)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_roundtrip_every_dtype_and_shape(dtype):
    tensors = {f"x{i}": sample(dtype, s) for i, s in enumerate(SHAPES)}
    tensors["noncontig"] = sample(dtype, (4, 6)).t()  # made contiguous on encode
    kind, meta, out = roundtrip_bytes(tensors)
    assert kind == "t" and meta == {"k": 1}
    for k, t in tensors.items():
        assert out[k].dtype == dtype and out[k].shape == t.shape
        assert torch.equal(out[k], t), k


def test_roundtrip_every_dtype_over_real_router_dealer_sockets():
    ctx = zmq.Context()
    limits = Limits()
    rx = learner_socket(ctx, "tcp://127.0.0.1:*", hwm=8, limits=limits)
    tx = worker_socket(ctx, rx.getsockopt_string(zmq.LAST_ENDPOINT), hwm=8, routing_id=b"w:1")
    try:
        sent = {}
        for name, dtype in DTYPES.items():
            tensors = {f"{name}_{i}": sample(dtype, s) for i, s in enumerate(SHAPES)}
            tensors["big"] = sample(dtype, (1 << 16,))  # above pyzmq's copy threshold: zero-copy path
            tx.send_multipart(encode(tensors, "t", {"dtype": name}), copy=False)
            sent[name] = tensors
        for _ in DTYPES:
            assert rx.poll(10_000)
            peer, frames, nbytes, err = recv_bounded(rx, limits)
            assert err is None and peer == b"w:1"
            _, meta, out = decode(frames, limits)
            assert nbytes == sum(len(f) for f in frames)
            for k, t in sent[meta["dtype"]].items():
                assert out[k].dtype == t.dtype and torch.equal(out[k], t), k
    finally:
        tx.close(0)
        rx.close(0)
        ctx.term()


def test_decode_is_zero_copy_for_aligned_frames():
    t = torch.arange(1 << 14, dtype=torch.float32)  # 64 KB: large enough for its own frame
    frames = encode({"x": t, "small": torch.ones(3)}, "t")
    assert len(frames) == 3 and frames[2].obj is not None  # a view on the tensor's own memory
    assert frames[2].obj.ctypes.data == t.data_ptr()
    backing = bytearray(frames[2])
    _, _, out = decode([frames[0], frames[1], backing])
    out["x"][0] = 42.0  # writes land in the received buffer: no hidden copy
    assert torch.frombuffer(backing, dtype=torch.float32)[0] == 42.0


def test_misaligned_frame_is_copied_not_misread():
    t = torch.arange(10, dtype=torch.int64)
    frames = encode({"x": t}, "t")
    raw = bytearray(b"\0" + bytes(frames[1]))
    view = memoryview(raw)[1:]  # address 1 byte off alignment
    _, _, out = decode([frames[0], view])
    assert torch.equal(out["x"], t)


def header(**over):
    h = {"magic": "streamrl", "schema": 2, "kind": "t", "meta": {}, "pack_below": 65536,
         "tensors": [{"key": "x", "dtype": "float32", "shape": [2]}]}
    h.update(over)
    return json.dumps(h).encode()


PAYLOAD = bytes(8)


@pytest.mark.parametrize("frames,limits,reason", [
    ([], Limits(), "empty"),
    ([header()] + [PAYLOAD] * 70, Limits(), "too_many_frames"),
    ([header(), bytes(2048)], Limits(max_message_bytes=1024), "oversized"),
    ([b" " * 70_000, PAYLOAD], Limits(), "header_too_large"),
    ([b"\xff\xfe", PAYLOAD], Limits(), "bad_header"),
    ([b"[" * 60_000, PAYLOAD], Limits(), "bad_header"),  # nesting: RecursionError is caught
    ([b'{"a": ' + b"9" * 5000 + b"}", PAYLOAD], Limits(), "bad_header"),  # int-digits limit
    ([b"[1, 2]", PAYLOAD], Limits(), "bad_magic"),
    ([header(schema=1), PAYLOAD], Limits(), "bad_schema_version"),
    ([header(pack_below="x"), PAYLOAD], Limits(), "bad_header"),
    ([header(schema=True), PAYLOAD], Limits(), "bad_schema_version"),
    ([header(kind=5), PAYLOAD], Limits(), "bad_kind"),
    ([header(meta=[]), PAYLOAD], Limits(), "bad_header"),
    ([header(), PAYLOAD, PAYLOAD], Limits(), "frame_count"),
    ([header(tensors=[{"key": "", "dtype": "float32", "shape": [2]}]), PAYLOAD], Limits(), "bad_key"),
    ([header(tensors=[{"key": "x" * 300, "dtype": "float32", "shape": [2]}]), PAYLOAD], Limits(), "bad_key"),
    ([header(tensors=[{"key": "x", "dtype": "object", "shape": [2]}]), PAYLOAD], Limits(), "bad_dtype"),
    ([header(), PAYLOAD], Limits(dtypes=frozenset({"int64"})), "bad_dtype"),  # whitelist subset
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [-2]}]), PAYLOAD], Limits(), "bad_shape"),
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [2.0]}]), PAYLOAD], Limits(), "bad_shape"),
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [1] * 5}]), PAYLOAD], Limits(), "bad_shape"),
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [2**50]}]), PAYLOAD], Limits(), "bad_shape"),
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [2]}] * 2), PAYLOAD, PAYLOAD], Limits(), "duplicate_key"),
    ([header(), bytes(7)], Limits(), "size_mismatch"),
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [20000]}]), b"", bytes(79999)], Limits(), "size_mismatch"),
    ([header(tensors=[{"key": "x", "dtype": "float32", "shape": [20000]}]), b""], Limits(), "frame_count"),
    ([header(), object()], Limits(), "bad_frame"),
])
def test_bad_frames_raise_frame_error_with_reason(frames, limits, reason):
    with pytest.raises(FrameError) as e:
        decode(frames, limits)
    assert e.value.reason == reason and reason in REASONS
    assert len(str(e.value)) < 400  # details are truncated: a hostile header cannot flood logs


def test_limits_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="max_tensors"):
        Limits(max_tensors=0)
    with pytest.raises(ValueError, match="dtypes"):
        Limits(dtypes=frozenset({"complex64"}))


def test_encode_rejects_unsupported_input():
    with pytest.raises(ValueError, match="dtype"):
        encode({"x": torch.zeros(2, dtype=torch.complex64)}, "t")
    with pytest.raises(ValueError, match="flat strings"):
        encode({("a", "b"): torch.zeros(2)}, "t")
