"""Byte layout of one weights version and the bucket checksums that guard it.

A version is one flat byte space: each tensor sits at a 64-byte aligned offset, and a
*bucket* is a contiguous run of tensors of about ``bucket_bytes``. Buckets are the unit
of gathering, transfer, readiness announcements and verification, so the publisher holds
at most one bucket of gathered tensors and a subscriber can verify (and re-fetch) each
bucket on its own. Padding bytes belong to the bucket they follow and are covered by its checksum
(zero in a fresh store file, old bytes in a recycled one: the checksum is of what is there).

Checksums (``algo`` in the manifest):

* ``sum64`` (default): the wrapping sum of the bucket's 64-bit words, computed by torch at
  memory speed, several times faster than zlib's crc32. It detects any change
  to a single word, truncation, zeroed or stale regions; it misses permutations of whole
  words, which no data plane here produces.
* ``crc32``: zlib's CRC32, stronger and slower.

Both are computed chunk by chunk right after each chunk is written (:class:`Checksum`), so
the second read hits the cache instead of memory.

A *packed* tensor (:class:`PackedSpec`) is one flat tensor that concatenates many small named
parts (a LoRA version: a few hundred adapter factors). The publisher moves it as one tensor (one
copy, one checksum run, one manifest entry); its entry carries ``"parts": {"names": [...], "shapes": [[...], ...]}``
(parallel lists: half the JSON items of one ``[name, shape]`` pair per part, and JSON encoding
costs per item) and :meth:`Layout.views` hands the parts out as views, so a version's consumers see the parts.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from streamrl.transport.codec import DTYPE_NAMES, DTYPES

ALIGN = 64
CHUNK = 1 << 20  # copy + checksum granularity: fits in L2, amortises Python overhead
ALGOS = ("sum64", "crc32")

Part = tuple[str, tuple[int, ...]]


class PackedSpec(tuple):
    """The spec ``(name, dtype, (N,))`` of a packed tensor: a flat [N] tensor of ``dtype`` holding
    ``parts`` (name, shape) back to back in order, without padding (N = their total numel).

    It unpacks like any ``(name, dtype, shape)`` spec; equal only to a spec with the same parts.
    """

    parts: tuple[Part, ...]

    def __new__(cls, name: str, dtype: torch.dtype, parts: list[Part]):
        parts = tuple((str(n), tuple(int(d) for d in shape)) for n, shape in parts)
        self = super().__new__(cls, (name, dtype, (sum(math.prod(shape) for _, shape in parts),)))
        self.parts = parts
        return self

    def __eq__(self, other) -> bool:
        return tuple.__eq__(self, other) and self.parts == getattr(other, "parts", None)

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


class ResidentTensors(list):
    """A version's tensors that are the weights themselves, not copies: each is (a view of) the
    storage the trainer updates in place, in specs order, and the same object is handed to every
    publish. A publisher may keep references to them and re-read them at the next version (the ipc
    plane replays the copies it recorded: :class:`~streamrl.weights.ipc.CopyPlan`).

    The contract the owner keeps: no tensor is re-pointed to new storage (``p.data = ...``,
    ``model.to(...)``) while the list is in use; in-place updates (the optimizer, a checkpoint
    load) are what it is for.
    """


def tensor_count(specs: list) -> int:
    """How many tensors a version of ``specs`` hands its consumers (a packed spec: its parts)."""
    return sum(len(s.parts) if isinstance(s, PackedSpec) else 1 for s in specs)


class ChecksumError(RuntimeError):
    """A weights bucket does not match its manifest checksum."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def sum64_digest(total: int) -> str:
    """The text of a sum64 checksum: ``total`` (a Python int, any size) modulo 2**64."""
    return str(total & 0xFFFFFFFFFFFFFFFF)


class Checksum:
    """Incremental checksum over a sequence of byte chunks (uint8 tensors, any device).

    ``sum64`` needs chunks whose lengths are multiples of 8 (the layout guarantees this
    for whole padded tensors); ``crc32`` needs CPU chunks.
    """

    def __init__(self, algo: str = "sum64"):
        if algo not in ALGOS:
            raise ValueError(f"weights checksum algo {algo!r} is unknown; choose one of {ALGOS}")
        self.algo = algo
        self._sums: dict[str, torch.Tensor] = {}  # per device type: partial sums stay on their device
        self._crc = 0

    def update(self, chunk: torch.Tensor) -> None:
        if chunk.numel() == 0:
            return
        if self.algo == "sum64":
            # int64 sums wrap modulo 2**64, so the result is independent of reduction order
            # (and of which device summed which chunk).
            dev = chunk.device.type
            s = chunk.view(torch.int64).sum()
            self._sums[dev] = s if dev not in self._sums else self._sums[dev] + s
        else:
            self._crc = zlib.crc32(memoryview(chunk.numpy()), self._crc)

    def device_total(self) -> torch.Tensor:
        """sum64's running total over chunks of one GPU, as an int64 [] tensor still on it: read it
        later (after the GPU is done) without waiting now. Only for sum64 over GPU chunks."""
        if self.algo != "sum64" or set(self._sums) - {"cuda"}:
            raise ValueError(f"Checksum.device_total: needs sum64 over GPU chunks, not {self.algo} over "
                             f"{sorted(self._sums)}")
        return self._sums["cuda"] if self._sums else torch.zeros((), dtype=torch.int64, device="cuda")

    def digest(self) -> str:
        if self.algo == "sum64":
            return sum64_digest(sum(int(s) for s in self._sums.values()))
        return f"{self._crc:08x}"


def checksum_region(buf: torch.Tensor, algo: str) -> str:
    """Checksum of a whole uint8 region (``buf``: [nbytes]), chunked like the writer."""
    c = Checksum(algo)
    for start in range(0, buf.numel(), CHUNK * 16):
        c.update(buf[start: start + CHUNK * 16])
    return c.digest()


def checksum_regions(bufs: list[torch.Tensor], algo: str) -> list[str]:
    """Checksums of whole uint8 regions (each [nbytes], a multiple of 8 for sum64), in order.

    sum64 on a GPU: one sum kernel per region and one device-to-host read for all of them, where
    a region at a time would wait for the GPU once per bucket. Anything else reads the regions
    on the CPU (crc32 needs host bytes), one at a time.
    """
    if algo == "sum64" and bufs and all(b.is_cuda for b in bufs):
        sums = torch.stack([b.view(torch.int64).sum() for b in bufs]).tolist()
        return [sum64_digest(s) for s in sums]
    return [checksum_region(b if algo == "sum64" else b.cpu(), algo) for b in bufs]


@dataclass
class Layout:
    """Where each tensor of a version lives.

    tensors: per tensor ``{"name", "dtype", "shape", "offset", "nbytes"}`` (engine names), and
    for a packed tensor ``"parts"``: ``{"names": [...], "shapes": [[...], ...]}`` (see :class:`PackedSpec`).
    buckets: per bucket ``{"offset", "nbytes", "first", "count"}``; tensors ``first ..
    first+count-1`` lie in ``[offset, offset+nbytes)``.
    """

    tensors: list[dict]
    buckets: list[dict]
    total_bytes: int

    @classmethod
    def plan(cls, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> "Layout":
        """Lay out ``(name, dtype, shape)`` specs in order; a new bucket starts when the next
        tensor would overflow ``bucket_bytes`` (a tensor larger than that gets its own bucket)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes = {bucket_bytes}: must be > 0")
        tensors, buckets = [], []
        off = b_start = b_first = 0
        for i, (name, dtype, shape) in enumerate(specs):
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {name!r} has unsupported dtype {dtype}")
            nbytes = math.prod(shape) * dtype.itemsize
            if i > b_first and off - b_start + nbytes > bucket_bytes:
                buckets.append({"offset": b_start, "nbytes": off - b_start, "first": b_first, "count": i - b_first})
                b_start, b_first = off, i
            entry = {"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape), "offset": off, "nbytes": nbytes}
            if isinstance(specs[i], PackedSpec):  # as JSON reads it back: lists
                entry["parts"] = {"names": [n for n, _ in specs[i].parts],
                                  "shapes": [list(shape) for _, shape in specs[i].parts]}
            tensors.append(entry)
            off = _align(off + nbytes)
        if specs:
            buckets.append({"offset": b_start, "nbytes": off - b_start, "first": b_first, "count": len(specs) - b_first})
        return cls(tensors, buckets, off)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "Layout":
        return cls(manifest["tensors"], manifest["buckets"], manifest["total_bytes"])

    def check(self) -> None:
        """Validate a layout read from Redis before allocating or mapping anything."""
        end = 0
        for b in self.buckets:
            if b["offset"] != end or b["nbytes"] < 0 or b["nbytes"] % 8:
                raise ValueError(f"weights manifest has a malformed bucket {b}")
            end = b["offset"] + b["nbytes"]
            for e in self.tensors[b["first"]: b["first"] + b["count"]]:
                if e["dtype"] not in DTYPES:
                    raise ValueError(f"weights manifest: tensor {e['name']} has unknown dtype {e['dtype']!r}")
                want = math.prod(e["shape"]) * torch.empty((), dtype=DTYPES[e["dtype"]]).element_size()
                if want != e["nbytes"] or e["offset"] < b["offset"] or e["offset"] + e["nbytes"] > end:
                    raise ValueError(f"weights manifest: tensor {e['name']} lies outside its bucket")
                if "parts" in e:
                    _check_parts(e)
        if end != self.total_bytes:
            raise ValueError(f"weights manifest: buckets cover {end} of {self.total_bytes} bytes")

    def bucket_tensors(self, index: int) -> list[dict]:
        b = self.buckets[index]
        return self.tensors[b["first"]: b["first"] + b["count"]]

    def views(self, index: int, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Typed views of bucket ``index``'s tensors over ``buf`` (uint8, the bucket's bytes)."""
        base = self.buckets[index]["offset"]
        out = []
        for e in self.bucket_tensors(index):
            dtype = DTYPES[e["dtype"]]
            lo = e["offset"] - base
            t = buf[lo: lo + e["nbytes"]].view(dtype)
            if "parts" not in e:
                out.append((e["name"], t.view(e["shape"])))
                continue
            start = 0  # a packed tensor: its parts, back to back
            for name, shape in zip(e["parts"]["names"], e["parts"]["shapes"]):
                n = math.prod(shape)
                out.append((name, t[start: start + n].view(shape)))
                start += n
        return out


def _check_parts(e: dict) -> None:
    """A packed entry's ``parts`` is ``{"names": [str, ...], "shapes": [[int >= 0, ...], ...]}``
    (as long as each other) filling its flat 1-d tensor exactly; raises ValueError naming the field."""
    parts, where = e["parts"], f"weights manifest: tensor {e['name']!r} field 'parts'"
    if (not isinstance(parts, dict) or sorted(parts) != ["names", "shapes"] or not isinstance(parts["names"], list)
            or not isinstance(parts["shapes"], list) or len(parts["names"]) != len(parts["shapes"])):
        raise ValueError(f"{where}: must be {{'names': [...], 'shapes': [...]}} of equal lengths, "
                         f"got {str(parts)[:80]}")
    if len(e["shape"]) != 1:
        raise ValueError(f"{where}: a packed tensor is 1-d, got shape {e['shape']}")
    total = 0
    for name, shape in zip(parts["names"], parts["shapes"]):
        if not isinstance(name, str) or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{where}: part {str(name)[:60]} {str(shape)[:40]} is not a name with a shape of dims >= 0")
        total += math.prod(shape)
    if total != e["shape"][0]:
        raise ValueError(f"{where}: parts hold {total} elements, the tensor {e['shape'][0]}")


def write_tensor(dst: torch.Tensor, src: torch.Tensor, checksum: Checksum | None) -> None:
    """Copy ``src`` (any device, contiguous) into ``dst`` (uint8 [padded nbytes], zero tail)
    chunk by chunk, feeding each written chunk to ``checksum`` while it is in cache."""
    flat = src.reshape(-1).view(torch.uint8) if src.numel() else src.new_empty(0, dtype=torch.uint8)
    n = flat.numel()
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        dst[start:stop].copy_(flat[start:stop])
        if checksum is not None:
            hi = stop if stop < n else dst.numel()  # the last chunk takes the zero padding
            checksum.update(dst[start:hi])
    if n == 0 and checksum is not None:
        checksum.update(dst)
