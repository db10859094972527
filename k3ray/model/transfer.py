"""Host-to-device copies of a serving step's small inputs that never make the host wait for the device.

A copy from pageable host memory (`torch.tensor(..., device="cuda")`, `.to("cuda")`) first waits for every kernel
queued before it (a stream synchronize): mid-step, the host then idles until the device catches up, and the device
idles while the host launches what follows. From pinned memory the copy is queued in stream order like a kernel.
"""
from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """`data` (a list, or a host tensor) as `dtype` on `device`, the host not waiting for the device: on a GPU
    copied from pinned memory, asynchronously in stream order (a copy from pageable memory, `torch.tensor(...,
    device=)`, first waits for every kernel queued before it: a stream synchronize)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype, device=device)
    host = torch.tensor(data, dtype=dtype, pin_memory=True) if not isinstance(data, torch.Tensor) \
        else data.to(dtype).pin_memory()
    return host.to(device, non_blocking=True)
