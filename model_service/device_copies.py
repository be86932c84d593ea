"""Copies between the host and the device that make the host wait at most once a step: a
leaf module that the device code and the sampler share.

torch.tensor(values, device="cuda") copies from pageable memory, and PyTorch then waits
for everything queued on the stream: a host sync, which lets the device run dry until
the host has queued the next kernels. Reading a device tensor (tolist, item) waits the
same way. A step's one host sync is its sampled tokens (and the logprobs asked for with
them) coming back: every list the runner or the sampler sends goes through to_device,
staged in pinned memory and copied asynchronously (the caching host allocator keeps the
staging block until the copy is done), and whatever a step reads back comes through
to_host, all in one wait. On CPU both are what they replace, at no extra cost.
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


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of `tensors` (on the CPU or one CUDA device), after one wait for that
    device: each is copied into pinned memory without waiting, then its stream is
    synchronized once. Those already on the CPU come back as they are."""
    devices = {tensor.device for tensor in tensors if tensor.device.type != "cpu"}
    if not devices:
        return list(tensors)
    (device,) = devices
    staged = [tensor if tensor.device.type == "cpu" else
              torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)
              for tensor in tensors]
    torch.cuda.current_stream(device).synchronize()
    return staged
