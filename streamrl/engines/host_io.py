"""Host-to-device copies that never stall the decode loop.

``torch.tensor(values, device="cuda")`` builds the tensor in pageable host memory and copies it
with ``non_blocking=False``: the host waits until the GPU has run everything queued before the
copy. A decode loop that edits block tables or slot caps that way between graph replays waits
for every replay, so the host can never run ahead. Here the values go through pinned memory and a
non-blocking copy instead; torch's pinned-memory allocator keeps the staging buffer alive until the
copy has run, so the caller may drop it at once.
"""
from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list or a CPU tensor) as a tensor on ``device``, without waiting for the device."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
