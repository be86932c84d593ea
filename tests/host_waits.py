"""What would make the host wait for a CUDA device, seen on CPU: reads of device values
(tolist, item, int(), nonzero, ...) and lists copied with torch.tensor(..., device=...)
(a copy from pageable memory, which waits for the stream). The code under test is run
with device_copies' to_device and to_host replaced by recording stand-ins: tensors that
to_host returned are on the host, and reading them is free."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy",
         "masked_select", "unique", "nonzero_static", "argwhere"}


class HostWaits(TorchFunctionMode):
    def __init__(self, monkeypatch, *modules) -> None:
        super().__init__()
        self.found: list[str] = []  # what would wait, by name
        self.sent: list = []  # the lists given to to_device
        self.read_backs = 0  # to_host calls
        self._on_host: set[int] = set()
        for module in modules:
            if hasattr(module, "to_device"):
                monkeypatch.setattr(module, "to_device", self._to_device)
            if hasattr(module, "to_host"):
                monkeypatch.setattr(module, "to_host", self._to_host)

    def _to_device(self, values, dtype, device):
        self.sent.append(values)
        return torch.tensor(values, dtype=dtype)

    def _to_host(self, *tensors):
        self.read_backs += 1
        copies = [tensor.clone() for tensor in tensors]
        self._on_host.update(id(copy) for copy in copies)
        return copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        read = name in READS and not (args and id(args[0]) in self._on_host)
        if read or (func is torch.tensor and "device" in kwargs):
            self.found.append(name)
        return func(*args, **kwargs)
