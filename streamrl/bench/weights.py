"""``streamrl-bench weights``: weight broadcast from ``publish()`` to the last ack.

For each data plane (shm, zmq, and with ``--device cuda`` ipc: device buffers shared through
CUDA IPC, engines loaded device to device), model size and subscriber count, the benchmark process is
the learner: it holds each parameter as two dim-0 shards (like a 2-rank FSDP2 learner) and
its gather makes the full tensor (``torch.cat``), so gather memory is real. Subscribers are
subprocesses with a preallocated "engine" (a dict of tensors, loaded by ``copy_``, all or
nothing) that follow versions as soon as they begin (streaming), verify, load and ack.

Rows are timed in a run's steady state: before the first row of a size the publisher
publishes until its store recycles files (pages allocated and page-locked once, as in a
long run); the best of ``--repeat`` rounds is kept.

Reported per row: end-to-end seconds from ``publish()`` to the last ack and GB/s; the split
gather / write (publisher) / transfer (subscriber fetch wall time, overlapping the publish)
/ verify / load (slowest subscriber); peak extra publisher memory (anonymous RSS above the
baseline, sampled every ms; shared-memory store pages are the data plane's, not counted);
and in the same run, on the same bytes: a plain single-threaded ``memcpy``, raw ZeroMQ
(bucket-sized zero-copy messages over TCP loopback to a subprocess, no checksums, no load) and,
for ipc, one device-to-device copy.
Every copy runs on one thread unless ``--sub-threads`` gives the subscribers more (the
baselines stay single-threaded). With a GPU learner / engine the store is page-locked for
CUDA (``--pin off``: the pageable path, for comparison).

With ``--json`` the last line is one JSON object: ``shm_ratio_vs_memcpy``,
``zmq_ratio_vs_raw_zmq`` and ``ipc_ratio_vs_d2d`` (largest size, 1 subscriber: baseline time /
end-to-end time),
``peak_extra_over_bucket`` (max over rows), and ``rows``. Rows of the ipc plane also give the
publisher's GPU memory: ``gpu_store_mb`` (its device buffer, kept between versions) and
``gpu_publish_peak_mb`` (allocated during a round above what was held before it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch
import zmq

from streamrl.coord.coordinator import Coordinator
from streamrl.engines.base import copy_weights_all_or_nothing
from streamrl.launcher.redis_server import RedisServer
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber

MB = 1 << 20
KEEP = 2  # store versions the publisher keeps


def _rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Max anonymous RSS above the starting value while active (1 ms sampling)."""

    def __init__(self):
        self.base = _rss_anon()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon() - self.base)
            time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_anon() - self.base)
        return self.peak


def make_model(total_bytes: int, tensor_bytes: int, device: str):
    """Specs and 2-shard storage of a model of ``total_bytes`` float32 weights."""
    specs, shards = [], []
    left, i = total_bytes, 0
    while left > 0:
        n = min(tensor_bytes, left) // 4 // 2 * 2 or 2
        rows = n // 256 if n % 256 == 0 and n >= 512 else n
        cols = n // rows
        specs.append((f"model.layers.{i}.weight", torch.float32, (rows, cols)))
        full = torch.randn(rows, cols, device=device)
        shards.append(list(full.chunk(2, 0)))
        left -= n * 4
        i += 1
    return specs, shards


def gather(shards):
    """Full tensors one at a time: a new allocation per parameter, like an FSDP all-gather."""
    for parts in shards:
        yield torch.cat(parts, 0)


def memcpy_s(nbytes: int, device: str, reps: int = 3) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best


def pinned_copy_s(nbytes: int, device: str, reps: int = 3) -> tuple[float, float]:
    """Best (D2H, H2D) seconds for ``nbytes`` between ``device`` and pinned host memory."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = h2d = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h = min(d2h, time.perf_counter() - t)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d = min(h2d, time.perf_counter() - t)
    return d2h, h2d


def device_copy_s(nbytes: int, device: str, reps: int = 3) -> float:
    """Best seconds of one device-to-device copy of ``nbytes`` on ``device``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def raw_zmq_s(nbytes: int, msg_bytes: int, reps: int = 2) -> float:
    """Best time to push ``nbytes`` in ``msg_bytes`` messages to a subprocess and hear back."""
    ctx = zmq.Context(io_threads=2)
    push = ctx.socket(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    done = ctx.socket(zmq.PULL)
    dport = done.bind_to_random_port("tcp://127.0.0.1")
    count = -(-nbytes // msg_bytes)
    proc = subprocess.Popen([sys.executable, "-m", "streamrl.bench.weights", "--raw-sink",
                             f"{port},{dport},{count},{reps + 1}"])
    msg_bytes = min(msg_bytes, nbytes)
    payload = bytearray(msg_bytes)
    best = float("inf")
    try:
        for r in range(reps + 1):  # the first round warms up the connection
            t = time.perf_counter()
            for k in range(count):  # same bytes as the model: full messages, then the remainder
                last = k == count - 1 and nbytes % msg_bytes
                push.send(bytearray(nbytes % msg_bytes) if last else payload, copy=False)
            if not done.poll(120_000):
                raise TimeoutError("raw zmq sink did not answer")
            done.recv()
            if r:
                best = min(best, time.perf_counter() - t)
    finally:
        proc.wait(timeout=30)
        push.close(0)
        done.close(0)
        ctx.term()
    return best


def _raw_sink(arg: str) -> int:
    port, dport, count, rounds = map(int, arg.split(","))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"tcp://127.0.0.1:{port}")
    done = ctx.socket(zmq.PUSH)
    done.connect(f"tcp://127.0.0.1:{dport}")
    for _ in range(rounds):
        for _ in range(count):
            pull.recv(copy=False)
        done.send(b"ok")
    time.sleep(0.2)
    return 0


class DictEngine:
    """Preallocated engine tensors (touched once, so loads measure copies, not page faults)."""

    def __init__(self, device: str):
        self.device = device
        self.params: dict[str, torch.Tensor] = {}

    def load_weights(self, named):
        items = list(named)
        if {n for n, _ in items} != set(self.params):
            self.params = {n: torch.zeros(t.shape, dtype=t.dtype, device=self.device) for n, t in items}
        copy_weights_all_or_nothing(self.params, items)  # the engines' load: one _foreach_copy_
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def _subscriber(args) -> int:
    torch.set_num_threads(args.sub_threads)
    coord = Coordinator(args.redis_url, args.run)
    sub = WeightSubscriber(coord, plane=args.plane, streams=args.streams, device=args.device,
                           pin_store=None if args.pin == "on" else False)
    engine = DictEngine(args.device)
    ps = coord.subscribe_versions()
    active_key = coord.keys._k("bench", "active")
    while coord.stop_reason() is None:
        v = coord.wait_version(sub.loaded_version, 1.0, pubsub=ps, poll_s=0.01, include_pending=True)
        if v is None or int(coord.r.get(active_key) or 0) < args.worker_id:
            if v is not None:
                sub.loaded_version = v  # not in this round: skip it
            continue
        sub.load(engine, args.worker_id, v)
    sub.close()
    return 0


def run_plane(plane: str, sizes_mb: list[int], subs: list[int], args, redis_url: str) -> list[dict]:
    """The best-of-``--repeat`` row of every (size, subscriber count) on one data plane."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    coord = Coordinator(redis_url, run)
    active_key = coord.keys._k("bench", "active")
    coord.r.set(active_key, 0)
    pub = WeightPublisher(coord, run, plane="ipc" if plane == "ipc" else "auto", bucket_bytes=args.bucket_mb * MB,
                          keep=KEEP, checksum=args.checksum, pin_store=args.pin == "on", ipc_buffers=args.ipc_buffers)
    procs = [subprocess.Popen([sys.executable, "-m", "streamrl.bench.weights", "--subscriber",
                               "--redis-url", redis_url, "--run", run, "--worker-id", str(w),
                               # ipc subscribers follow the manifest's plane
                               "--plane", "auto" if plane == "ipc" else plane, "--streams", str(args.streams),
                               "--device", args.sub_device,
                               "--pin", args.pin, "--sub-threads", str(args.sub_threads)])
             for w in range(1, max(subs) + 1)]
    rows, version = [], 0
    try:
        for size in sizes_mb:
            nbytes = size * MB
            specs, shards = make_model(nbytes, min(args.tensor_mb * MB, nbytes), args.device)
            base = _baselines(plane, nbytes, args)
            subs_run = [n for n in subs if _mem_estimate(plane, nbytes, n) <= args.max_mem_gb * (1 << 30)]
            for n in subs:
                if n not in subs_run:
                    print(f"# skip {plane} {size} MB x{n}: over --max-mem-gb", file=sys.stderr)
                    continue
                coord.r.set(active_key, n)
                # Warm-up: the first round allocates engines; the first row of a size also
                # publishes until the store recycles its files (keep + 1 versions), so timed
                # rounds see the steady state of a run (pages allocated, mapped, page-locked).
                warm = KEEP + 1 if n == subs_run[0] else 1
                best = None
                for rep in range(args.repeat + warm):
                    e2e, pt, peak, st, gpu_peak = _publish_round(pub, coord, version, specs, shards, n, plane)
                    version += 1
                    if rep >= warm:
                        row = _row(plane, size, n, e2e, pt, peak, st, base, args.bucket_mb * MB)
                        if gpu_peak is not None:  # ipc: the publisher's GPU memory beside the learner's weights
                            row.update(ipc_buffers=args.ipc_buffers, gpu_store_mb=pub.store.nbytes / MB,
                                       gpu_publish_peak_mb=gpu_peak / MB)
                        best = row if best is None or row["e2e_s"] < best["e2e_s"] else best
                rows.append(best)
                _print_row(best)
            del shards
    finally:
        coord.request_stop("bench done")
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        pub.close()
        coord.close()
    return rows


def _baselines(plane: str, nbytes: int, args) -> dict:
    """Seconds of the bare copies a row is compared with, on the same bytes: ``memcpy``,
    ``raw_zmq`` (zmq plane only, else None), ``d2d`` (ipc plane only, else None), ``pinned``
    (GPU learner: (D2H, H2D), else None)."""
    return {"memcpy": memcpy_s(nbytes, args.device),
            "raw_zmq": raw_zmq_s(nbytes, args.bucket_mb * MB) if plane == "zmq" else None,
            "d2d": device_copy_s(nbytes, args.device) if plane == "ipc" else None,
            "pinned": pinned_copy_s(nbytes, args.device) if args.device.startswith("cuda") else None}


def _publish_round(pub, coord, version: int, specs, shards, n: int, plane: str
                   ) -> tuple[float, dict, int, list, int | None]:
    """Publish ``version`` and wait for subscribers 1..n: (end-to-end seconds, publisher
    timings, peak extra publisher bytes, each subscriber's timings, and on the ipc plane the
    peak GPU bytes this process allocated above what it held before the round: the gather's full
    tensors and anything else the publish allocates, the store's buffer being already there)."""
    workers = list(range(1, n + 1))
    gpu0 = None
    if plane == "ipc":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated()
    sampler = PeakSampler()
    t0 = time.perf_counter()
    pt = pub.publish(version, specs, gather(shards), background=True)  # as the learner publishes
    # polled every 0.1 ms: the acks' arrival, not the poll's period, is what is timed
    if not coord.wait_acks(version, workers, timeout_s=300, poll_s=0.0001):
        raise TimeoutError(f"{plane}: subscribers did not ack v{version}")
    e2e = time.perf_counter() - t0
    peak = sampler.stop()
    gpu_peak = None if gpu0 is None else torch.cuda.max_memory_allocated() - gpu0
    return e2e, pt, peak, [coord.weight_timings(w) for w in workers], gpu_peak


def _row(plane: str, size: int, n: int, e2e: float, pt: dict, peak: int, st: list[dict], base: dict,
         bucket_bytes: int) -> dict:
    """One result row: end-to-end figures, the slowest subscriber's split, ratios to the baselines."""
    nbytes = size * MB
    row = {
        "plane": plane, "size_mb": size, "subscribers": n, "e2e_s": e2e,
        "gbps": nbytes / e2e / 1e9,
        "publish_s": pt["weights/publish_s"],  # what the learner waits for
        "gather_s": pt["weights/gather_s"], "write_s": pt["weights/write_s"],
        "transfer_s": max(s.get("weights/transfer_s", 0) for s in st),
        "verify_s": max(s.get("weights/verify_s", 0) for s in st),
        "load_s": max(s.get("weights/load_s", 0) for s in st),
        "peak_extra_mb": peak / MB, "peak_extra_over_bucket": peak / bucket_bytes,
        "memcpy_gbps": nbytes / base["memcpy"] / 1e9,
        "ratio_vs_memcpy": base["memcpy"] / e2e,
    }
    if base["pinned"] is not None:  # GPU learner: D2H + host plane + H2D vs the bare pinned copies
        d2h, h2d = base["pinned"]
        row.update(pinned_d2h_gbps=nbytes / d2h / 1e9, pinned_h2d_gbps=nbytes / h2d / 1e9,
                   ratio_vs_pinned_d2h_h2d=(d2h + h2d) / e2e)
    if base["raw_zmq"] is not None:
        row.update(raw_zmq_gbps=nbytes / base["raw_zmq"] / 1e9, ratio_vs_raw_zmq=base["raw_zmq"] / e2e)
    if base["d2d"] is not None:
        row.update(d2d_gbps=nbytes / base["d2d"] / 1e9, ratio_vs_d2d=base["d2d"] / e2e)
    return row


def _mem_estimate(plane: str, nbytes: int, n: int) -> int:
    per_sub = nbytes * (2 if plane == "zmq" else 1)  # received buffers + engine
    return nbytes * 4 + n * per_sub  # model + gather + 2 kept store versions


def _print_row(r: dict) -> None:
    extra = f" raw_zmq {r['raw_zmq_gbps']:.2f} GB/s ratio {r['ratio_vs_raw_zmq']:.2f}" if "raw_zmq_gbps" in r else ""
    extra += f" d2d {r['d2d_gbps']:.2f} GB/s ratio {r['ratio_vs_d2d']:.2f}" if "d2d_gbps" in r else ""
    if "gpu_store_mb" in r:
        extra += f" | GPU store {r['gpu_store_mb']:.0f} MB, publish peak +{r['gpu_publish_peak_mb']:.0f} MB"
    print(f"{r['plane']:>4} {r['size_mb']:>6} MB x{r['subscribers']}: {r['e2e_s']:.3f} s {r['gbps']:.2f} GB/s | "
          f"publish {r['publish_s']:.3f} (gather {r['gather_s']:.3f} write {r['write_s']:.3f}) "
          f"transfer {r['transfer_s']:.3f} verify {r['verify_s']:.3f} load {r['load_s']:.3f} | peak +{r['peak_extra_mb']:.0f} MB | "
          f"memcpy {r['memcpy_gbps']:.2f} GB/s ratio {r['ratio_vs_memcpy']:.2f}{extra}", flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="streamrl-bench weights", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--sizes", default="10,100,1000", help="model sizes in MB, comma-separated (up to 2000)")
    p.add_argument("--subscribers", default="1,2,4", help="subscriber counts, comma-separated (1-4)")
    p.add_argument("--planes", default="shm,zmq", help="data planes to measure: shm, zmq, ipc (--device cuda)")
    p.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MB")
    p.add_argument("--ipc-buffers", type=int, default=1, choices=(1, 2), help="ipc: the learner's device buffers")
    p.add_argument("--tensor-mb", type=int, default=16, help="size of each model tensor in MB")
    p.add_argument("--checksum", default="sum64", choices=["sum64", "crc32"])
    p.add_argument("--streams", type=int, default=2, help="ZeroMQ streams per subscriber")
    p.add_argument("--repeat", type=int, default=2, help="timed rounds per row (best is kept)")
    p.add_argument("--device", default="cpu", help="learner tensors' device: cpu or cuda (D2H + transfer + H2D)")
    p.add_argument("--pin", default="on", choices=["on", "off"],
                   help="page-lock the store for CUDA copies (GPU learner / engine; off = pageable path)")
    p.add_argument("--sub-threads", type=int, default=1,
                   help="torch threads of each subscriber (verify + load); baselines stay single-threaded")
    p.add_argument("--max-mem-gb", type=float, default=12.0, help="skip rows estimated to need more memory")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    # internal roles
    p.add_argument("--subscriber", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw-sink", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-id", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--plane", default="shm", help=argparse.SUPPRESS)
    p.add_argument("--sub-device", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sub_device = a.sub_device or a.device
    return a


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.raw_sink:
        return _raw_sink(args.raw_sink)
    if args.subscriber:
        return _subscriber(args)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        subs = [int(s) for s in args.subscribers.split(",") if s]
        planes = [s for s in args.planes.split(",") if s]
    except ValueError:
        raise ValueError(f"--sizes {args.sizes!r} / --subscribers {args.subscribers!r}: expected integers")
    if not sizes or min(sizes) < 1 or max(sizes) > 4096:
        raise ValueError(f"--sizes {args.sizes!r}: each must be in [1, 4096] MB")
    if not subs or min(subs) < 1 or max(subs) > 8:
        raise ValueError(f"--subscribers {args.subscribers!r}: each must be in [1, 8]")
    if args.sub_threads < 1:
        raise ValueError(f"--sub-threads {args.sub_threads}: must be >= 1")
    if set(planes) - {"shm", "zmq", "ipc"}:
        raise ValueError(f"--planes {args.planes!r}: choose from shm, zmq, ipc")
    if "ipc" in planes and not (args.device.startswith("cuda") and args.sub_device.startswith("cuda")):
        raise ValueError(f"--planes {args.planes!r}: ipc shares GPU buffers, it needs --device cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device!r}: no CUDA device here")
    torch.set_num_threads(1)  # every copy in this benchmark, baselines included, uses one thread
    server = None
    url = args.redis_url
    if url is None:
        server = RedisServer(Path(tempfile.mkdtemp(prefix="streamrl-bench-redis-"))).start()
        url = server.url
    rows = []
    try:
        for plane in planes:
            rows += run_plane(plane, sizes, subs, args, url)
    finally:
        if server is not None:
            server.stop()
    out = {"bench": "weights", "device": args.device, "bucket_mb": args.bucket_mb, "checksum": args.checksum,
           "pin": args.pin, "sub_threads": args.sub_threads, "rows": rows}
    for plane, key, base in (("shm", "shm_ratio_vs_memcpy", "ratio_vs_memcpy"),
                             ("zmq", "zmq_ratio_vs_raw_zmq", "ratio_vs_raw_zmq"),
                             ("ipc", "ipc_ratio_vs_d2d", "ratio_vs_d2d")):
        one = [r for r in rows if r["plane"] == plane and r["subscribers"] == 1]
        if one:
            out[key] = max(one, key=lambda r: r["size_mb"])[base]
    if rows:
        out["peak_extra_over_bucket"] = max(r["peak_extra_over_bucket"] for r in rows)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
