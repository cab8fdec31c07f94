"""Moving a packed trajectory batch from rank 0 to every rank with tensor broadcasts.

No pickle: rank 0 broadcasts a small int64 header (per-key lengths in a fixed key order,
from the schema), then each tensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from streamrl.trajectory import FIELDS


def broadcast_batch(td: TensorDict | None, src: int = 0) -> TensorDict:
    """Broadcast a packed trajectory batch (schema keys only) from ``src`` to all ranks."""
    keys = list(FIELDS)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert td is not None
        return td
    header = torch.zeros(len(keys), dtype=torch.int64)
    if dist.get_rank() == src:
        header = torch.tensor([td[k].numel() for k in keys], dtype=torch.int64)
    dist.broadcast(header, src)
    out = {}
    for k, n in zip(keys, header.tolist()):
        dtype = FIELDS[k][0]
        if dist.get_rank() == src:
            t = td[k].contiguous()
        else:
            t = torch.empty(n, dtype=dtype)
        # gloo has no bool broadcast: ship bools as uint8.
        wire = t.to(torch.uint8) if dtype == torch.bool else t
        dist.broadcast(wire, src)
        out[k] = wire.to(torch.bool) if dtype == torch.bool else wire
    return TensorDict(out, batch_size=[])


def broadcast_flag(value: int, src: int = 0) -> int:
    """Broadcast one integer (e.g. 'stop now') from ``src``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src)
    return int(t.item())
