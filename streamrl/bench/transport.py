"""``streamrl-bench transport [--json]``: the trajectory stream against three baselines.

For each message size (4 KB .. 64 MB of realistic packed trajectory batches) and in one run,
interleaved round by round so machine load hits all methods alike, it measures throughput
and messages/s of

* ``streamrl``   – :class:`TrajectorySender` → :class:`TrajectoryReceiver` (codec, credits,
  full validation, sequence tracking, dedup): what the learner really runs;
* ``raw_zmq``    – one ZeroMQ frame of the same byte size, PUSH → PULL, zero-copy both ends;
* ``pickle_zmq`` – ``send_pyobj`` / ``recv_pyobj`` of the same tensor dict over PUSH → PULL;
* ``redis_json`` – JSON lists over a Redis stream (XADD / XREAD / XDEL), the way PipelineRL
  moves samples, against a real ``redis-server`` started for the run.

All use TCP loopback; the sender is one child process (as a rollout worker is) and the
receiver this process (as learner rank 0 is). Figures are ratios taken side by side on a
shared machine, not absolute capacities. Redis JSON
moves ~20 MB/s, so it gets at most ``--redis-bytes`` per size (one message from 16 MB) and
is skipped above ``--redis-max-size`` (16 MB by default: a 64 MB batch as JSON lists takes
GBs of Python objects and minutes on 2 cores).

With ``--json`` the last printed line is one JSON object: ``ratio_vs_raw_zmq`` (geometric
mean over sizes >= 1 MB), ``ratio_vs_pickle_zmq`` and ``ratio_vs_redis_json`` (geometric
means over all sizes measured; ``*_ge_1MB`` over sizes >= 1 MB), their minima (``*_min``),
and the per-size ``table``. A ratio is StreamRL bytes/s over the baseline's, per size.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import pickle  # used ONLY by the in-process pickle baseline below, never by StreamRL itself
import statistics
import sys
import tempfile
import time

import redis
import torch
import zmq
from tensordict import TensorDict

from streamrl.launcher.redis_server import RedisServer
from streamrl.trajectory import make_id, pack_trajectories
from streamrl.transport.receiver import TrajectoryReceiver
from streamrl.transport.sender import TrajectorySender
from streamrl.transport.codec import Limits

SIZES = ["4K", "64K", "1M", "4M", "16M", "64M"]
METHODS = ["streamrl", "raw_zmq", "pickle_zmq", "redis_json"]
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = _UNITS.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if text[-1:] in _UNITS else text) * mult)
    except ValueError:
        raise ValueError(f"--sizes: cannot parse size {text!r} (use e.g. 4K, 1M, 64M)") from None
    if value < 1024:
        raise ValueError(f"--sizes: size {text!r} is below 1 KB")
    return value


def make_batch(nbytes: int, worker_id: int = 1) -> TensorDict:
    """A packed trajectory batch of about ``nbytes`` on the wire.

    Trajectories have a prompt of 1/4 their response length; one response token costs 21
    bytes (token 8, mask 1, logprob 4, version 8), one prompt token 8, one trajectory ~52 fixed.
    Big batches hold many ~24 KB trajectories (1024 response tokens), small ones one short one.
    """
    b = max(1, nbytes // (24 * 1024))
    resp = max(4, int((nbytes / b - 52) / (21 + 8 / 4)))
    prompt = max(1, resp // 4)
    g = torch.Generator().manual_seed(nbytes)
    n_r, n_p = b * resp, b * prompt
    now = time.time()
    return TensorDict({
        "prompt_lens": torch.full((b,), prompt, dtype=torch.int64),
        "response_lens": torch.full((b,), resp, dtype=torch.int64),
        "prompt_tokens": torch.randint(0, 150_000, (n_p,), generator=g),
        "response_tokens": torch.randint(0, 150_000, (n_r,), generator=g),
        "response_mask": torch.rand(n_r, generator=g) > 0.05,
        "behaviour_logprobs": -torch.rand(n_r, generator=g) * 5,
        "policy_version": torch.randint(0, 50, (n_r,), generator=g),
        "reward": torch.rand(b, generator=g),
        "group_id": torch.arange(b, dtype=torch.int64) // 8,
        "traj_id": torch.arange(b, dtype=torch.int64),
        "worker_id": torch.full((b,), worker_id, dtype=torch.int64),
        "created_at": torch.full((b,), now, dtype=torch.float64),
    }, batch_size=[])


def wire_bytes(td: TensorDict) -> int:
    return sum(t.numel() * t.element_size() for t in td.values())


class _Counter:
    """Fresh trajectory ids per message (the receiver drops duplicates, as it should)."""

    def __init__(self, worker_id: int):
        self.worker_id, self.next = worker_id, 0

    def fresh(self, td: TensorDict) -> TensorDict:
        b = td["traj_id"].numel()
        # A new tensor each time: sends are zero-copy, so queued batches must not be mutated.
        ids = torch.arange(b, dtype=torch.int64) + make_id(self.worker_id, self.next)
        self.next += b
        return TensorDict({**dict(td.items()), "traj_id": ids}, batch_size=[])


# --------------------------------------------------------------------------- sender process
# Each method's sender runs in one child process (a rollout worker is a process too; threads
# would serialize both ends on the GIL). The parent sends it JSON commands over a pipe.

def _sender_main(conn) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    batches: dict[int, TensorDict] = {}
    ids = _Counter(1)
    while True:
        cmd = json.loads(conn.recv_bytes())
        if cmd["method"] == "exit":
            break
        td = batches.setdefault(cmd["size"], make_batch(cmd["size"]))
        k, hwm, target = cmd["count"], cmd["hwm"], cmd["target"]
        if cmd["method"] == "streamrl":
            tx = TrajectorySender(target, worker_id=1, hwm=hwm, ctx=ctx)
            for _ in range(k):
                tx.send(ids.fresh(td))
            tx.flush(120.0)
            tx.close()
        elif cmd["method"] in ("raw_zmq", "pickle_zmq"):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, hwm)
            push.setsockopt(zmq.LINGER, -1)  # flush everything; the parent reads it all
            push.connect(target)
            if cmd["method"] == "raw_zmq":
                payload = bytes(wire_bytes(td))
                for _ in range(k):
                    push.send(payload, copy=False)
            else:
                # BASELINE ONLY: pickle over ZeroMQ, the common shortcut StreamRL refuses to take.
                plain = dict(td.items())
                for _ in range(k):
                    plain["traj_id"] = ids.fresh(td)["traj_id"]
                    push.send(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
            push.close()
        elif cmd["method"] == "redis_json":
            client = redis.Redis.from_url(target)
            stream = cmd["stream"]
            for _ in range(k):
                while client.xlen(stream) >= hwm:  # same bound on queued messages as the others
                    time.sleep(0.001)
                msg = {key: t.tolist() for key, t in ids.fresh(td).items()}
                client.xadd(stream, {"data": json.dumps(msg)})
            client.close()
        conn.send_bytes(b"done")
    ctx.term()


class SenderProcess:
    """The child process that plays the rollout worker for every method."""

    def __init__(self):
        # fork (before this process creates ZeroMQ contexts or torch threads) starts in
        # milliseconds; spawn would re-import torch, which takes seconds on a busy machine.
        mp = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        self.conn, child = mp.Pipe()
        self.proc = mp.Process(target=_sender_main, args=(child,), daemon=True)
        self.proc.start()

    def start(self, **cmd) -> None:
        self.conn.send_bytes(json.dumps(cmd).encode())

    def wait(self, timeout_s: float = 120.0) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"benchmark sender did not finish within {timeout_s} s")
        self.conn.recv_bytes()

    def close(self) -> None:
        try:
            self.conn.send_bytes(json.dumps({"method": "exit"}).encode())
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _timed(recv_one, n: int, warm: int) -> float:
    for _ in range(warm):
        recv_one()
    t0 = time.perf_counter()
    for _ in range(n):
        recv_one()
    return time.perf_counter() - t0


def bench_streamrl(ctx, sender, size, b, n, warm, hwm) -> float:
    rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=hwm, limits=Limits(max_message_bytes=512 * 1024**2), ctx=ctx)
    pending: list = []

    def recv_one():
        while not pending:
            # One message per call, like the baselines' recv: poll() otherwise keeps draining
            # while data streams in, and the timer would start after the whole transfer.
            pending.extend(rx.poll(30.0, max_messages=1))
        got = pending.pop()
        if got["traj_id"].numel() != b:
            raise RuntimeError(f"streamrl: got {got['traj_id'].numel()} trajectories, sent {b}")

    try:
        sender.start(method="streamrl", size=size, count=warm + n, hwm=hwm, target=rx.endpoint)
        dt = _timed(recv_one, n, warm)
        sender.wait()
        if rx.stats()["transport/rejected"]:
            raise RuntimeError(f"streamrl benchmark saw rejects: {rx.stats()}")
        return dt
    finally:
        rx.close()


def _pull(ctx, hwm):
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, hwm)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, 30_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    return pull, f"tcp://127.0.0.1:{port}"


def bench_raw_zmq(ctx, sender, size, b, n, warm, hwm) -> float:
    pull, endpoint = _pull(ctx, hwm)
    try:
        sender.start(method="raw_zmq", size=size, count=warm + n, hwm=hwm, target=endpoint)
        dt = _timed(lambda: pull.recv(copy=False), n, warm)
        sender.wait()
        return dt
    finally:
        pull.close()


def bench_pickle_zmq(ctx, sender, size, b, n, warm, hwm) -> float:
    # BASELINE ONLY: unpickling is what StreamRL never does with network bytes. Here the
    # socket is bound to loopback for the seconds this runs and its only peer is this
    # benchmark's own child process.
    pull, endpoint = _pull(ctx, hwm)

    def recv_one():
        got = pickle.loads(pull.recv(copy=False).buffer)  # baseline only, see above
        if got["traj_id"].numel() != b:
            raise RuntimeError("pickle baseline lost trajectories")

    try:
        sender.start(method="pickle_zmq", size=size, count=warm + n, hwm=hwm, target=endpoint)
        dt = _timed(recv_one, n, warm)
        sender.wait()
        return dt
    finally:
        pull.close()


def bench_redis_json(client, url, sender, size, b, dtypes, n, warm, hwm) -> float:
    stream = f"streamrl-bench-{os.getpid()}"
    client.delete(stream)
    last = ["0-0"]

    def recv_one():
        deadline = time.monotonic() + 300
        while True:
            got = client.xread({stream: last[0]}, count=1, block=1000)
            if got:
                break
            if time.monotonic() > deadline or not sender.proc.is_alive():
                raise RuntimeError("redis baseline: no message within 300 s or the sender died")
        entry_id, fields = got[0][1][0]
        last[0] = entry_id
        client.xdel(stream, entry_id)
        msg = json.loads(fields[b"data"])
        out = {k: torch.tensor(v, dtype=dtypes[k]) for k, v in msg.items()}
        if out["traj_id"].numel() != b:
            raise RuntimeError("redis baseline lost trajectories")

    try:
        sender.start(method="redis_json", size=size, count=warm + n, hwm=hwm, target=url, stream=stream)
        dt = _timed(recv_one, n, warm)
        sender.wait()
        return dt
    finally:
        client.delete(stream)


def _count(size: int, budget: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, budget // size))


def run(sizes: list[int], rounds: int, zmq_bytes: int, redis_bytes: int, hwm: int, use_redis: bool,
        log=print, redis_max: int = 16 * 1024**2) -> dict:
    """Measure every method at every size; returns the result dict (see module docstring)."""
    sender = SenderProcess()  # first: fork before any ZeroMQ context or torch thread exists
    ctx = zmq.Context()
    server = client = None
    tmp = tempfile.TemporaryDirectory(prefix="streamrl-bench-")
    if use_redis:
        server = RedisServer(tmp.name).start()
        client = redis.Redis.from_url(server.url, socket_timeout=60)
    batches = {s: make_batch(s) for s in sizes}  # same deterministic batches as the sender's
    t_start = time.perf_counter()
    times: dict[tuple[str, int], list[float]] = {}
    counts: dict[tuple[str, int], int] = {}
    try:
        for r in range(rounds):
            for s in sizes:
                td = batches[s]
                nb, b = wire_bytes(td), int(td["traj_id"].numel())
                for m in METHODS:
                    if m == "redis_json" and (client is None or r > 0 or s > redis_max):
                        continue  # one round is plenty at ~20 MB/s; its noise is far below the margin
                    if m == "redis_json":
                        n, warm = _count(nb, redis_bytes, 1, 200), (1 if nb <= 4 * 1024**2 else 0)
                        dtypes = {k: t.dtype for k, t in td.items()}
                        dt = bench_redis_json(client, server.url, sender, s, b, dtypes, n, warm, hwm)
                    else:
                        n, warm = _count(nb, zmq_bytes, 4, 300), 2
                        fn = {"streamrl": bench_streamrl, "raw_zmq": bench_raw_zmq, "pickle_zmq": bench_pickle_zmq}[m]
                        dt = fn(ctx, sender, s, b, n, warm, hwm)
                    times.setdefault((m, s), []).append(dt / n)
                    counts[(m, s)] = n
                log(f"round {r + 1}/{rounds} size {_fmt(s)} done ({time.perf_counter() - t_start:.0f} s)")
    finally:
        sender.close()
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        ctx.term()
        tmp.cleanup()
    return summarize(sizes, batches, times, counts)


def summarize(sizes, batches, times, counts) -> dict:
    table = []
    for s in sizes:
        nb = wire_bytes(batches[s])
        row = {"size": _fmt(s), "bytes": nb, "trajectories": int(batches[s]["traj_id"].numel())}
        for m in METHODS:
            if (m, s) not in times:
                row[f"{m}_GBps"] = row[f"{m}_msgs_per_s"] = None
                continue
            per_msg = statistics.median(times[(m, s)])
            row[f"{m}_GBps"] = round(nb / per_msg / 1e9, 4)
            row[f"{m}_msgs_per_s"] = round(1 / per_msg, 1)
            row[f"{m}_messages"] = counts[(m, s)]
        for base in ("raw_zmq", "pickle_zmq", "redis_json"):
            a, b = row["streamrl_GBps"], row[f"{base}_GBps"]
            row[f"ratio_vs_{base}"] = round(a / b, 3) if a and b else None
        table.append(row)

    def agg(base, pred):
        vals = [r[f"ratio_vs_{base}"] for r, s in zip(table, sizes) if pred(s) and r[f"ratio_vs_{base}"]]
        if not vals:
            return None, None
        return round(math.exp(sum(map(math.log, vals)) / len(vals)), 3), round(min(vals), 3)

    big = lambda s: s >= 1024**2  # noqa: E731
    out = {"benchmark": "transport", "table": table}
    for base, pred in (("raw_zmq", big), ("pickle_zmq", lambda s: True), ("redis_json", lambda s: True)):
        out[f"ratio_vs_{base}"], out[f"ratio_vs_{base}_min"] = agg(base, pred)
    # Same two baselines restricted to trajectory-batch sizes (>= 1 MB), as for raw ZeroMQ.
    for base in ("pickle_zmq", "redis_json"):
        out[f"ratio_vs_{base}_ge_1MB"], _ = agg(base, big)
    out["targets"] = {"ratio_vs_raw_zmq": 0.8, "ratio_vs_pickle_zmq": 2.5, "ratio_vs_redis_json": 50}
    return out


def _fmt(n: int) -> str:
    for unit, mult in (("M", 1024**2), ("K", 1024)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def print_table(result: dict) -> None:
    head = f"{'size':>6} {'B':>5} | " + " | ".join(f"{m:>18}" for m in METHODS) + " | vs raw  vs pickle  vs redis"
    print(head)
    print(f"{'':>6} {'':>5} | " + " | ".join(f"{'GB/s':>8} {'msg/s':>9}" for _ in METHODS) + " |")
    for row in result["table"]:
        cells = []
        for m in METHODS:
            g, r = row[f"{m}_GBps"], row[f"{m}_msgs_per_s"]
            cells.append(f"{g:>8.3f} {r:>9.0f}" if g is not None else f"{'-':>8} {'-':>9}")
        ratios = "  ".join(f"{row[f'ratio_vs_{b}'] or float('nan'):>7.2f}" for b in ("raw_zmq", "pickle_zmq", "redis_json"))
        print(f"{row['size']:>6} {row['trajectories']:>5} | " + " | ".join(cells) + " | " + ratios)
    for key, target in result["targets"].items():
        val = result[key]
        ok = "ok" if val is not None and val >= target else "BELOW TARGET"
        print(f"{key} = {val} (min {result[key + '_min']}; target >= {target}) {ok}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="streamrl-bench transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated message sizes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds for the ZeroMQ methods; median taken")
    p.add_argument("--zmq-bytes", default="96M", help="bytes per method, size and round over ZeroMQ (>= 4 msgs)")
    p.add_argument("--redis-bytes", default="32M", help="bytes per size for Redis JSON (>= 1 message)")
    p.add_argument("--hwm", type=int, default=8, help="queued-message bound used by every method")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis JSON baseline")
    p.add_argument("--redis-max-size", default="16M",
                   help="largest message size tried over Redis JSON (64 MB as JSON lists needs GBs of "
                        "Python objects and minutes on 2 cores; default %(default)s)")
    args = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        zmq_bytes, redis_bytes = parse_size(args.zmq_bytes), parse_size(args.redis_bytes)
        redis_max = parse_size(args.redis_max_size)
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = run(sizes, args.rounds, zmq_bytes, redis_bytes, args.hwm, not args.no_redis,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True), redis_max=redis_max)
    result["redis_json_max_size"] = _fmt(redis_max)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    print(f"wall {result['wall_s']} s")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
