"""ZeroMQ data plane: buckets served from the publisher's store to subscribers on any host.

Wire (no pickle; JSON headers, raw bytes):

* subscriber DEALER -> publisher ROUTER: one frame, JSON ``{"v": version, "i": bucket}``.
* reply: two frames, JSON ``{"v", "i", "ok"}`` then the bucket's bytes (empty if not ok).

The server thread owns the ROUTER socket and sends straight from the store's shared
mapping with ``copy=False`` (zero-copy; libzmq holds a reference until the bytes are out).
Subscribers only ask for buckets that Redis announced ready, and at most ``window``
requests per stream are in flight, which bounds queued memory on both sides. A subscriber
may open several streams (DEALER sockets) and spread buckets over them: on a multi-core
host the kernel and libzmq I/O threads then move several buckets at once.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable

import zmq

from streamrl.security import apply_client_keys, apply_server_keys, load_curve_keys, stop_authenticator

log = logging.getLogger(__name__)


class BucketServer:
    """Serves ``(version, bucket) -> memoryview`` from ``lookup`` over a ROUTER socket."""

    def __init__(self, lookup: Callable[[int, int], memoryview | None], bind: str = "tcp://127.0.0.1:*",
                 advertise_host: str | None = None, io_threads: int = 2):
        self.lookup = lookup
        self.ctx = zmq.Context(io_threads=io_threads)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not silent drop
        apply_server_keys(self.sock, load_curve_keys("server"))  # CURVE when configured in the environment
        self.sock.bind(bind)
        ep = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise_host:
            ep = f"tcp://{advertise_host}:{ep.rsplit(':', 1)[1]}"
        self.endpoint = ep
        self.served_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weights-zmq-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                ident, raw = self.sock.recv_multipart()
                req = json.loads(raw)
                v, i = int(req["v"]), int(req["i"])
            except (ValueError, KeyError, TypeError, zmq.ZMQError) as e:
                log.warning("bad weights request: %s", e)
                continue
            data = self.lookup(v, i)
            head = json.dumps({"v": v, "i": i, "ok": data is not None}).encode()
            payload = data if data is not None else b""
            try:
                self.sock.send_multipart([ident, head, payload], copy=False)
                self.served_bytes += len(payload)
            except zmq.ZMQError as e:  # peer went away
                log.info("weights reply to a gone peer dropped: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.sock.close(0)
        stop_authenticator(self.ctx)  # a live ZAP thread would keep ctx.term() waiting
        self.ctx.term()


class BucketClient:
    """Fetch buckets over ``streams`` parallel DEALER sockets, ``window`` requests each."""

    def __init__(self, endpoint: str, streams: int = 2, window: int = 2, ctx: zmq.Context | None = None):
        if streams < 1 or window < 1:
            raise ValueError(f"weights zmq_streams = {streams} / window = {window}: must be >= 1")
        self.endpoint = endpoint
        # One libzmq I/O thread per stream (up to 4): each thread receives its own socket's
        # buckets, so on a multi-core host streams really run side by side.
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context(io_threads=min(streams, 4))
        self.window = window
        self.socks = []
        self.poller = zmq.Poller()
        keys = load_curve_keys("client")  # read once (env / key files), not per stream
        for _ in range(streams):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            apply_client_keys(s, keys)
            s.connect(endpoint)
            self.poller.register(s, zmq.POLLIN)
            self.socks.append(s)
        self.inflight = {id(s): 0 for s in self.socks}
        self.queue: list[tuple[int, int]] = []

    def request(self, version: int, index: int) -> None:
        self.queue.append((version, index))
        self._pump()

    def _pump(self) -> None:
        while self.queue:
            s = min(self.socks, key=lambda s: self.inflight[id(s)])
            if self.inflight[id(s)] >= self.window:
                return
            v, i = self.queue.pop(0)
            s.send(json.dumps({"v": v, "i": i}).encode())
            self.inflight[id(s)] += 1

    def pending(self) -> int:
        return len(self.queue) + sum(self.inflight.values())

    def poll(self, timeout_ms: int) -> list[tuple[int, int, memoryview | None]]:
        """Replies that arrived: ``(version, bucket, bytes or None if the server lacks it)``."""
        out = []
        for s, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    head, data = s.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.inflight[id(s)] -= 1
                h = json.loads(head.bytes)
                out.append((int(h["v"]), int(h["i"]), data.buffer if h.get("ok") else None))
        self._pump()
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        if self._own_ctx:
            self.ctx.term()
