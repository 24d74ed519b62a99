"""Host values onto the device without waiting for the work already queued there.

A plain copy from pageable host memory to a CUDA device (``torch.tensor(values, device=...)``)
waits for everything queued on the stream before it: within a step, for the step's forward. The
host then cannot enqueue the next step while this one runs, which is what asynchronous
scheduling is for. Through pinned memory the copy is queued like a kernel instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list, or a tensor on the host) as a tensor on ``device``, copied without a sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return values.to(device, dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, device=device)
    host = values.to(dtype=dtype).pin_memory() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
