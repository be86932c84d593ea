"""A CUDA stand-in for the KV tiers' tests on a machine without a GPU.

``FakeCudaTensor`` is a CPU tensor that says it is on CUDA (``is_cuda``), refuses
``numpy()`` as a CUDA tensor does, and logs every copy-like operation it takes part in
(``ops``): a test counts the copies a batch makes. ``FakeCuda`` replaces the torch.cuda
calls the tiers make (streams, events, ``cudart().cudaHostRegister``) and records them;
its events can hold a copy mid-flight (``hold``) until the test lets it finish.
"""

from __future__ import annotations

import contextlib
import threading

import torch

# What a copy between host memory and the device, or within the device, goes through.
COPY_OPS = {"copy_", "index_copy_", "index_select", "clone", "contiguous", "to", "cpu", "index_put_"}


class FakeCudaTensor(torch.Tensor):
    ops: list[str] = []  # every copy-like op on a fake, in order (shared by all instances)

    @property
    def is_cuda(self) -> bool:
        return True

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in COPY_OPS:
            cls.ops.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def on_fake_cuda(tensor: torch.Tensor) -> FakeCudaTensor:
    return tensor.as_subclass(FakeCudaTensor)


class FakeCuda:
    """torch.cuda as the tiers use it; ``log`` holds "sync" for each event waited on."""

    def __init__(self, monkeypatch) -> None:
        self.registered: dict[int, int] = {}  # data_ptr -> bytes page-locked (cudaHostRegister)
        self.unregistered: list[int] = []
        self.log: list[str] = []
        self.devices_set: list[tuple[str, object]] = []  # (thread name, device) per torch.cuda.set_device
        self.hold = threading.Event()  # set: the next event waited on blocks until ``release``
        self.holding = threading.Event()  # set while a wait is held
        self._release = threading.Event()
        fake = self

        class Stream:
            def __init__(self, device=None) -> None:
                pass

            def wait_stream(self, other) -> None:
                pass

            def synchronize(self) -> None:
                fake.log.append("sync")

        class Event:
            def record(self, stream=None) -> None:
                pass

            def synchronize(self) -> None:
                if fake.hold.is_set():
                    fake.hold.clear()
                    fake.holding.set()
                    assert fake._release.wait(30), "the test never released the held copy"
                    fake.holding.clear()
                fake.log.append("sync")

        class Cudart:
            @staticmethod
            def cudaHostRegister(ptr: int, size: int, flags: int) -> int:
                fake.registered[ptr] = size
                return 0

            @staticmethod
            def cudaHostUnregister(ptr: int) -> int:
                fake.unregistered.append(ptr)
                return 0

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: fake.devices_set.append(
            (threading.current_thread().name, device)))
        FakeCudaTensor.ops = []

    def release(self) -> None:
        self._release.set()
