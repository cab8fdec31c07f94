"""Page-lock the shared-memory store for CUDA, so GPU copies to and from it are plain DMA.

A GPU learner's tensors reach the store by a device-to-host copy, and a GPU engine loads
them by a host-to-device copy. Into or out of *pageable* memory the CUDA driver stages
each copy through its own pinned buffer, one extra host pass at a few GB/s; registered
(page-locked) memory is read or written by the copy engine directly at PCIe speed.

The store's files are long-lived mappings (the publisher recycles them, the subscriber
caches them by inode), so each is registered once, not per version. A subscriber maps the
store read-only and registers it with ``cudaHostRegisterReadOnly`` (the GPU only reads it).

Everything here is best effort: without CUDA, or when registration fails (an old driver,
a locked-memory limit), the caller keeps the pageable path, which is correct, only slower.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PORTABLE = 1   # cudaHostRegisterPortable: pinned for every CUDA context of the process
READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads it (needed for PROT_READ pages)


def cuda_ready() -> bool:
    return torch.cuda.is_available()


def register(buf: torch.Tensor, read_only: bool = False) -> bool:
    """Page-lock ``buf`` (a CPU uint8 tensor [nbytes] over a mapping) for CUDA; True on success."""
    if not cuda_ready() or buf.numel() == 0:
        return False
    flags = PORTABLE | (READ_ONLY if read_only else 0)
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), flags))
    if err != 0:
        log.warning("cudaHostRegister of %d MB failed (cudaError %d); weights copies stay pageable",
                    buf.numel() >> 20, err)
        return False
    return True


def unregister(buf: torch.Tensor) -> None:
    if cuda_ready() and buf.numel():
        err = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
        if err != 0:
            log.warning("cudaHostUnregister failed (cudaError %d)", err)
