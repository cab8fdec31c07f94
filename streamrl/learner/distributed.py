"""Moving a packed trajectory batch from rank 0 to every rank in two broadcasts.

No pickle: rank 0 broadcasts a small int64 header (for every schema key, required and
optional, in a fixed order: present flag and shape), then one uint8 buffer holding every
present tensor's bytes back to back. Two collectives per step instead of one per key
(the per-key version cost 27–43 ms for a 1–16 MB batch on gloo, all of it call overhead).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from tensordict import TensorDict

from streamrl.trajectory import ALL_FIELDS

_MAX_NDIM = 3  # widest schema tensor (routed_experts [R, L, k])


def broadcast_batch(td: TensorDict | None, src: int = 0) -> TensorDict:
    """Broadcast a packed trajectory batch (every schema key it holds) from ``src`` to all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert td is not None
        return td
    keys = list(ALL_FIELDS)
    is_src = dist.get_rank() == src
    header = torch.zeros(len(keys), 1 + _MAX_NDIM, dtype=torch.int64)
    if is_src:
        for i, k in enumerate(keys):
            if k in td.keys():
                shape = list(td[k].shape)
                header[i, 0] = 1 + len(shape)  # 0 = absent, else 1 + ndim
                header[i, 1: 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    dist.broadcast(header, src)
    layout = []  # (key, dtype, shape, offset, nbytes)
    offset = 0
    for k, row in zip(keys, header.tolist()):
        if row[0] == 0:
            continue
        dtype, shape = ALL_FIELDS[k][0], row[1: row[0]]
        nbytes = math.prod(shape) * dtype.itemsize
        layout.append((k, dtype, shape, offset, nbytes))
        offset += (nbytes + 7) // 8 * 8  # 8-byte aligned slots: every dtype view stays legal
    buf = torch.zeros(offset, dtype=torch.uint8)
    if is_src:
        for k, _, _, o, n in layout:
            buf[o: o + n] = td[k].contiguous().view(-1).view(torch.uint8)
    dist.broadcast(buf, src)
    out = {k: buf[o: o + n].view(dtype).view(shape) for k, dtype, shape, o, n in layout}
    return TensorDict(out, batch_size=[])


def broadcast_flag(value: int, src: int = 0) -> int:
    """Broadcast one integer (e.g. 'stop now') from ``src``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src)
    return int(t.item())
