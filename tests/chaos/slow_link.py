"""A slow, lossy link where the kernel has no ``sch_netem``: delay through NFQUEUE, loss through
iptables' ``statistic`` match, both applied to one device of a network namespace.

What it emulates is ``tc qdisc add dev D root netem delay Dms loss L%`` on both ends of a link:
every packet leaving or entering device D of namespace NS is dropped with probability L, and
the rest are held ``delay_ms`` before the kernel lets them through (so a round trip across D
gains 2 x delay_ms). The delay is real packet holding in the kernel's queue, released by a
verdict from this module's daemon, which speaks the nfnetlink_queue protocol over a raw netlink
socket (the protocol of libnetfilter_queue, which is not installed here):

* bind queue N, copy mode META (the kernel sends each queued packet's id, not its bytes);
* each packet message carries ``NFQA_PACKET_HDR`` (its id); the delay is the same for every
  packet, so ids become due in arrival order and one ``VERDICT_BATCH`` accepts all due ids.

The rules jump to the queue with ``--queue-bypass``: if the daemon is gone, packets pass
instead of being dropped. Run the daemon with ``python -m tests.chaos.slow_link --queue N
--delay-ms D`` inside the namespace; :func:`degraded` does all of it for a test.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterator

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT_BATCH, NFQNL_MSG_CONFIG = 0, 3, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND, NFQNL_COPY_META = 1, 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
NF_ACCEPT = 1
SOL_NETLINK, NETLINK_NO_ENOBUFS, SO_RCVBUFFORCE = 270, 5, 33
READY = "slow_link: bound"
CHAIN = "SLOWLINK"


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _message(msg_type: int, queue: int, attrs: list[bytes], flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


def _messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(nlmsg type, payload after the netlink header) of each message in one datagram."""
    off = 0
    while off + 16 <= len(data):
        size, kind = struct.unpack_from("=IH", data, off)
        if size < 16:
            return
        yield kind, data[off + 16:off + size]
        off += (size + 3) & ~3


def _packet_id(payload: bytes) -> int | None:
    """The id in a packet message's NFQA_PACKET_HDR (after the 4-byte nfgenmsg)."""
    off = 4
    while off + 4 <= len(payload):
        size, kind = struct.unpack_from("=HH", payload, off)
        if size < 4:
            return None
        if kind & 0x7FFF == NFQA_PACKET_HDR:
            return struct.unpack_from("!I", payload, off + 4)[0]
        off += (size + 3) & ~3
    return None


class DelayQueue:
    """Bound to nfnetlink queue ``queue``; :meth:`run` holds each packet ``delay_s`` then accepts it."""

    def __init__(self, queue: int, delay_s: float):
        self.queue, self.delay_s = queue, delay_s
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        # a burst past the buffer loses those packets (like a full qdisc), not the daemon
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        self._configure(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)))
        self._configure(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
        self._configure(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)))

    def _configure(self, attr: bytes) -> None:
        self.sock.send(_message(NFQNL_MSG_CONFIG, self.queue, [attr], NLM_F_REQUEST | NLM_F_ACK))
        for kind, payload in _messages(self.sock.recv(65536)):
            if kind == NLMSG_ERROR and (err := struct.unpack_from("=i", payload)[0]) != 0:
                raise OSError(-err, f"nfnetlink_queue config of queue {self.queue}: {os.strerror(-err)}")

    def run(self) -> None:
        held: deque[tuple[float, int]] = deque()  # (release time, packet id), in arrival order
        while True:
            timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
            if select.select([self.sock], [], [], timeout)[0]:
                now = time.monotonic()
                for kind, payload in _messages(self.sock.recv(1 << 20)):
                    if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET and (pid := _packet_id(payload)) is not None:
                        held.append((now + self.delay_s, pid))
            due = None
            now = time.monotonic()
            while held and held[0][0] <= now:
                due = held.popleft()[1]
            if due is not None:  # accepts every queued id <= due
                self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue,
                                        [_attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, due))]))


def _iptables(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "iptables", "-w", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)} in {ns}: {r.stderr.strip()}")


def _rules(dev: str, loss: float, queue: int) -> list[list[str]]:
    drop = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.4f}", "-j", "DROP"]
    hold = ["-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
    return [["-A", CHAIN, "-o", dev, *drop], ["-A", CHAIN, "-i", dev, *drop],
            ["-A", CHAIN, "-o", dev, *hold], ["-A", CHAIN, "-i", dev, *hold]]


@contextlib.contextmanager
def degraded(ns: str, dev: str, delay_ms: float, loss: float, queue: int = 7) -> Iterator[str]:
    """Within the block, every packet through ``dev`` of namespace ``ns`` (both directions) is
    dropped with probability ``loss`` and the rest delayed ``delay_ms``. Yields a description."""
    repo = Path(__file__).resolve().parents[2]
    daemon = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-u", "-m", "tests.chaos.slow_link",
                               "--queue", str(queue), "--delay-ms", str(delay_ms)],
                              cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the daemon binds its queue and says so at once, or dies saying why
        line = daemon.stdout.readline() if select.select([daemon.stdout], [], [], 30)[0] else "(nothing in 30 s)"
        if line.strip() != READY:
            raise RuntimeError(f"slow_link daemon in {ns} did not start: {line}{daemon.stdout.read()}")
        _iptables(ns, "-N", CHAIN)
        for rule in _rules(dev, loss, queue):
            _iptables(ns, *rule)
        _iptables(ns, "-I", "OUTPUT", "-j", CHAIN)
        _iptables(ns, "-I", "INPUT", "-j", CHAIN)
        yield f"{delay_ms:.0f} ms delay and {loss:.0%} loss each way (NFQUEUE + iptables statistic)"
    finally:
        for args in (["-D", "OUTPUT", "-j", CHAIN], ["-D", "INPUT", "-j", CHAIN], ["-F", CHAIN], ["-X", CHAIN]):
            with contextlib.suppress(RuntimeError):
                _iptables(ns, *args)
        daemon.kill()
        daemon.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    args = p.parse_args()
    q = DelayQueue(args.queue, args.delay_ms / 1000.0)
    print(READY, flush=True)
    q.run()


if __name__ == "__main__":
    main()
