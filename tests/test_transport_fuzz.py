"""Fuzzing a live TrajectoryReceiver over a real socket.

10,000+ messages: random frames and targeted mutations of a valid trajectory message (header
bytes, JSON fields, frame layout, tensor values). The receiver must never raise, must count
every message, must reject every one of the guaranteed-invalid ones with a named reason,
and must still deliver valid trajectories sent afterwards, bit for bit.
"""
from __future__ import annotations

import json
import logging
import random
import time

import torch
import zmq

from streamrl.trajectory import make_id, pack_trajectories
from streamrl.transport.channel import KIND
from streamrl.transport.receiver import TrajectoryReceiver
from streamrl.transport.sender import TrajectorySender
from streamrl.transport.codec import Limits, decode, encode

N_MESSAGES = 10_000
LIMITS = Limits(max_message_bytes=1 << 20, max_tensors=32)
WORKER = 5


def valid_batch(counter: int, worker: int = WORKER):
    lens = [(3, 20), (2, 20)]
    ids = [make_id(worker, counter * 10 + i) for i in range(2)]
    return pack_trajectories(
        [[1] * p for p, _ in lens], [list(range(r)) for _, r in lens],
        [[-0.1] * r for _, r in lens], [[0] * r for _, r in lens], [0.5, 1.0], [ids[0]] * 2, ids,
        worker, 1000.0, started_at=999.0,
        # 40 tokens x 32 layers x 32 experts x int16 = 80 KB: its own zero-copy frame
        routed_experts=[torch.randint(0, 64, (r, 32, 32)) for _, r in lens],
    )


def meta(seq: int) -> dict:
    return {"worker_id": WORKER, "session": 1234, "seq": seq, "trajectory_schema": 1, "sent_at": 1.0}


class Fuzzer:
    """Makes messages; ``sure`` says whether the message is invalid by construction."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.base = valid_batch(0)
        self.base_frames = [bytes(f) for f in encode(dict(self.base.items()), KIND, meta(0))]
        self.header = json.loads(self.base_frames[0])
        self.seq = 1

    def frames_with(self, header: dict, rest=None) -> list[bytes]:
        return [json.dumps(header).encode()] + list(rest if rest is not None else self.base_frames[1:])

    def value_mutation(self) -> list[bytes]:
        d = {k: v.clone() for k, v in self.base.items()}
        r = self.rng
        choice = r.randrange(12)
        if choice == 0:
            d["behaviour_logprobs"][r.randrange(40)] = float("nan")
        elif choice == 1:
            d["behaviour_logprobs"][r.randrange(40)] = 0.5
        elif choice == 2:
            d["prompt_lens"][r.randrange(2)] = r.choice([0, -3])
        elif choice == 3:
            d["response_lens"][r.randrange(2)] += r.choice([1, -1, 2**33])
        elif choice == 4:
            d["policy_version"][r.randrange(40)] = -1
        elif choice == 5:
            d["worker_id"][r.randrange(2)] = WORKER + 1
        elif choice == 6:
            d["traj_id"][r.randrange(2)] = -r.randrange(1, 2**40)
        elif choice == 7:
            d["routed_experts"][r.randrange(40)] = -2
        elif choice == 8:
            d["created_at"][0] = float("inf")
        elif choice == 9:
            d["started_at"][1] = 5000.0
        elif choice == 10:
            key = r.choice(["reward", "traj_id", "response_mask", "created_at"])
            d[key] = d[key].to(torch.float16 if key != "reward" else torch.float64)
        else:
            if r.random() < 0.5:
                d.pop(r.choice(["reward", "group_id", "policy_version"]))
            else:
                d["surprise"] = torch.zeros(2)
        return [bytes(f) for f in encode(d, KIND, meta(self.next_seq()))]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def header_mutation(self) -> list[bytes]:
        h = json.loads(json.dumps(self.header))
        h["meta"]["seq"] = self.next_seq()
        r = self.rng
        entries = h["tensors"]
        e = entries[r.randrange(len(entries))]
        choice = r.randrange(14)
        if choice == 0:
            e["dtype"] = r.choice(["object", "complex64", "", 5, None, "float128"])
        elif choice == 1:
            e["shape"] = r.choice([[-1], "x", [1.5], [1] * 9, [2**41], None, [True]])
        elif choice == 2:
            e["key"] = r.choice(["", "k" * 300, 7, None])
        elif choice == 3:
            h["magic"] = r.choice(["streamrI", "", None, 0])
        elif choice == 4:
            h["schema"] = r.choice([1, 3, "2", True, None])
        elif choice == 5:
            h["kind"] = r.choice(["weights", "", 3, None])
        elif choice == 6:
            h["pack_below"] = r.choice([-1, "a", None, 1.5])
        elif choice == 7:
            h["meta"][r.choice(["seq", "worker_id", "session"])] = r.choice(["1", -1, 2**64, None, 1.5])
        elif choice == 8:
            h["meta"]["trajectory_schema"] = r.choice([0, 2, "1", None])
        elif choice == 9:
            entries.append(dict(e))  # duplicate key
        elif choice == 10:
            entries.remove(e)  # layout no longer matches the frames
        elif choice == 11:
            e["key"] = "zz" + e["key"][2:]  # unknown key, same layout
        elif choice == 12:
            h["meta"] = r.choice([[], "x", None])
        else:
            h["tensors"] = r.choice([{}, "x", None, [1, 2]])
        return self.frames_with(h)

    def layout_mutation(self) -> list[bytes]:
        f = list(self.base_frames)
        f[0] = json.dumps({**self.header, "meta": meta(self.next_seq())}).encode()
        r = self.rng
        choice = r.randrange(7)
        if choice == 0:
            f.pop()  # drop the big frame
        elif choice == 1:
            f.append(bytes(r.randrange(0, 64)))
        elif choice == 2:
            f[1] = f[1][: -r.randrange(1, len(f[1]))]
        elif choice == 3:
            f[2] = f[2][: -r.randrange(1, 100)]
        elif choice == 4:
            f[1] = f[1] + bytes(r.randrange(1, 9))
        elif choice == 5:
            f = [f[0]] + [b"x"] * 40  # too many frames
        else:
            f = [f[0], bytes(600_000), bytes(600_000)]  # oversized in total
        return f

    def raw_mutation(self) -> list[bytes]:
        r = self.rng
        choice = r.randrange(8)
        if choice == 0:
            return [r.randbytes(r.randrange(0, 3000)) for _ in range(r.randrange(1, 6))]
        if choice == 1:
            return [self.base_frames[0][: r.randrange(0, len(self.base_frames[0]))]] + self.base_frames[1:]
        if choice == 2:
            return [b"[" * r.randrange(2000, 60_000)] + self.base_frames[1:]
        if choice == 3:
            return [b'{"magic": ' + b"9" * 5000 + b"}"]
        if choice == 4:
            return [b"\xff" * 10 + self.base_frames[0]] + self.base_frames[1:]
        if choice == 5:
            return [b" " * 70_000]
        if choice == 6:
            return [b""]
        hello = {"magic": "streamrl", "schema": 2, "kind": "hello", "pack_below": 65536, "tensors": [],
                 "meta": {"worker_id": r.choice([-1, "x"]), "session": 1, "sent_bytes": 0}}
        return [json.dumps(hello).encode(), b""]

    def flip(self) -> list[bytes]:
        """Random byte flips anywhere: may or may not stay valid (not counted as sure)."""
        f = [bytearray(x) for x in self.base_frames]
        for _ in range(self.rng.randrange(1, 4)):
            i = self.rng.randrange(len(f))
            if f[i]:
                j = self.rng.randrange(len(f[i]))
                f[i][j] ^= 1 << self.rng.randrange(8)
        return [bytes(x) for x in f]

    def message(self) -> tuple[list[bytes], bool]:
        k = self.rng.random()
        if k < 0.25:
            return self.value_mutation(), True
        if k < 0.55:
            return self.header_mutation(), True
        if k < 0.75:
            return self.layout_mutation(), True
        if k < 0.92:
            return self.raw_mutation(), True
        return self.flip(), False


def test_fuzzed_frames_are_counted_and_valid_traffic_survives(caplog):
    caplog.set_level(logging.WARNING, logger="streamrl.transport.receiver")
    ctx = zmq.Context()
    rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=64, limits=LIMITS, ctx=ctx)
    fuzz = ctx.socket(zmq.DEALER)
    fuzz.setsockopt(zmq.SNDHWM, 2000)
    fuzz.setsockopt(zmq.LINGER, 0)
    fuzz.connect(rx.endpoint)
    gen = Fuzzer(seed=1234)
    sure = accepted = 0
    t0 = time.monotonic()
    try:
        sent = 0
        while sent < N_MESSAGES:
            chunk = min(500, N_MESSAGES - sent)
            for _ in range(chunk):
                frames, is_sure = gen.message()
                sure += is_sure
                fuzz.send_multipart(frames)
            sent += chunk
            deadline = time.monotonic() + 60
            while rx.received_messages < sent and time.monotonic() < deadline:
                accepted += len(rx.poll(0.1))
            assert rx.received_messages == sent, (rx.received_messages, sent)
        stats = rx.stats()
        rejected = stats["transport/rejected"]
        # every message was read and accounted for; every sure-invalid one rejected with a reason
        # (random bit flips may still be valid, or duplicates of the base batch)
        assert stats["transport/messages"] == N_MESSAGES
        assert rejected >= sure, (rejected, sure, dict(rx.rejected))
        assert accepted + rejected <= N_MESSAGES
        reasons = {k.removeprefix("transport/rejected_") for k in stats if k.startswith("transport/rejected_")}
        for expected in ("bad_header", "bad_dtype", "bad_shape", "bad_key", "frame_count", "size_mismatch",
                         "too_many_frames", "oversized", "header_too_large", "bad_magic", "bad_kind",
                         "bad_schema_version", "bad_meta", "duplicate_key", "non_finite", "bad_logprob",
                         "bad_length", "bad_version", "worker_mismatch", "bad_id", "bad_expert",
                         "bad_timestamp", "missing_key", "unknown_key"):
            assert expected in reasons, (expected, sorted(reasons))
        assert sum(rx.rejected.values()) == rejected
        assert any("rejected trajectory message" in r.message for r in caplog.records)

        # Afterwards a real worker's batches arrive intact.
        tx = TrajectorySender(rx.endpoint, worker_id=WORKER, ctx=ctx)
        good = [valid_batch(1000 + i) for i in range(5)]
        for td in good:
            assert tx.send(td, timeout_s=10)
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 5 and time.monotonic() < deadline:
            got += rx.poll(0.2)
        assert len(got) == 5
        for a, b in zip(good, got):
            for k in a.keys():
                assert torch.equal(a[k], b[k]), k
        tx.close()
    finally:
        fuzz.close()
        rx.close()
        ctx.term()
    assert time.monotonic() - t0 < 120


def test_frame_above_maxmsgsize_drops_only_that_connection():
    """libzmq drops a peer announcing a frame larger than MAXMSGSIZE; the receiver lives on."""
    ctx = zmq.Context()
    rx = TrajectoryReceiver("tcp://127.0.0.1:*", limits=LIMITS, ctx=ctx)
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(rx.endpoint)
    try:
        bad.send_multipart([b"x", bytes(2 << 20)])
        assert rx.poll(0.5) == []
        tx = TrajectorySender(rx.endpoint, worker_id=WORKER, ctx=ctx)
        td = valid_batch(77)
        assert tx.send(td, timeout_s=10)
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got += rx.poll(0.2)
        assert len(got) == 1 and torch.equal(got[0]["routed_experts"], td["routed_experts"])
        tx.close()
    finally:
        bad.close()
        rx.close()
        ctx.term()
