"""Lists from the host to the device without making the host wait: a leaf module that
the device code and the sampler share.

torch.tensor(values, device="cuda") copies from pageable memory, and PyTorch then waits
for everything queued on the stream: a host sync, which lets the device run dry until
the host has queued the next kernels. A step's one host sync is its sampled tokens
coming back; every other list the runner or the sampler sends goes through to_device:
staged in pinned memory and copied asynchronously (the caching host allocator keeps the
staging block until the copy is done). On CPU it is torch.tensor, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of `values` (a list, or a list of equal-length lists) on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
