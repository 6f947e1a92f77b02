"""Host lists to device tensors without a host-device sync.

A plain `torch.tensor(values, device="cuda")` (or assigning a CPU tensor into a CUDA one)
copies from pageable memory, which waits for every kernel already queued on the stream: the
scheduler would block on the previous batch. Pinned memory and a non-blocking copy do not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
