"""The adapters a server holds, by the name requests use for them.

`--lora-modules NAME=PATH` is read whole at start: every adapter is loaded and checked
before any is registered, so a bad one stops the start with its message and none is
half-served. At run time (lora_admin.py) one adapter is loaded at a time: its name and slot
are held (`reserve`) while its file is read off the event loop, and it is registered only
once read and checked whole.

Unloading takes the name away at once (new requests get NOT_FOUND), but an adapter that
running requests still use keeps its slot and its bytes counted until the last of them
ends (`release`): the slot is free only when its memory is, so --max-loras adapters never
hold more than the slots the pool's sizing kept for them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch

from model_service import metrics
from model_service.lora.peft_adapter import AdapterError, LoraAdapter, load_adapter, max_adapter_bytes
from model_service.models.config import ModelConfig
from pagedkv.lora_slots import RANK_CEILING

# Names travel in the OpenAI `model` field, URLs and metric labels.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 64


def check_name(name: str, where: str) -> None:
    """AdapterError unless `name` may name an adapter (it travels in URLs and metric labels)."""
    if not _NAME.match(name):
        raise AdapterError(f"{where}: the name must be 1-128 letters, digits or ._:/- "
                           f"and start with a letter or digit")


def parse_lora_module(text: str) -> tuple[str, str]:
    """'NAME=PATH' -> (name, path); raises AdapterError naming the expected form."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise AdapterError(f"--lora-modules {text!r}: expected NAME=PATH (the directory peft's "
                           f"save_pretrained wrote)")
    check_name(name, f"--lora-modules {text!r}")
    return name, path


class SlotsFull(AdapterError):
    """Every --max-loras slot is held (loaded, being loaded, or draining)."""


class Duplicate(AdapterError):
    """The name is loaded already, or being loaded."""


class LoraRegistry:
    """Up to max_loras adapters by name, each of rank at most max_rank."""

    def __init__(self, config: ModelConfig, *, max_loras: int = DEFAULT_MAX_LORAS,
                 max_rank: int = DEFAULT_MAX_LORA_RANK, base_name: str | None = None,
                 runtime: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if max_loras < 0:
            raise ValueError(f"--max-loras must be 0 (no adapters) or more, got {max_loras}")
        if not 1 <= max_rank <= RANK_CEILING:
            raise ValueError(f"--max-lora-rank must be between 1 and {RANK_CEILING}, got {max_rank}")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.base_name = base_name
        # Adapters may be loaded after start (--lora-load-dir): their slots are kept from the start.
        self.runtime = runtime
        self.dtype = dtype
        self.device = device
        self._adapters: dict[str, LoraAdapter] = {}
        self._reserved: set[str] = set()  # names whose files are being read
        # Adapters that requests hold, by id: how many requests each, and those unloaded
        # while held (their slots come free when the count drops to 0).
        self._users: dict[int, int] = {}
        self._draining: dict[int, LoraAdapter] = {}

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """What max_loras adapters of the largest allowed rank hold in `dtype` (the pool's
        sizing); 0 while no adapter is loaded and none may be: LoRA is off and reserves nothing."""
        if not self._adapters and not self.runtime:
            return 0
        return self.max_loras * max_adapter_bytes(self.config, self.max_rank, dtype.itemsize)

    def resident_bytes(self) -> int:
        """Bytes of every adapter held: those loaded and those unloaded that requests still use."""
        return sum(a.nbytes for a in self._adapters.values()) + sum(a.nbytes for a in self._draining.values())

    def slots_used(self) -> int:
        return len(self._adapters) + len(self._reserved) + len(self._draining)

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoraAdapter]:
        return list(self._adapters.values())

    def load_all(self, modules: Sequence[str], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> list[LoraAdapter]:
        """Loads every NAME=PATH of --lora-modules, registering them only once all passed."""
        pairs = [parse_lora_module(text) for text in modules]
        names = [name for name, _ in pairs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise AdapterError(f"--lora-modules names {duplicates} more than once; each name picks one adapter")
        self._check_room(names)
        loaded = [load_adapter(name, path, self.config, max_rank=self.max_rank, dtype=dtype, device=device)
                  for name, path in pairs]
        self._register(loaded)
        return loaded

    def reserve(self, name: str) -> None:
        """Holds `name` and a slot for an adapter about to be read; Duplicate or SlotsFull.
        The caller then calls either register() or unreserve()."""
        self._check_room([name])
        self._reserved.add(name)

    def unreserve(self, name: str) -> None:
        self._reserved.discard(name)

    def register(self, adapter: LoraAdapter) -> None:
        """Registers a reserved adapter, read and checked whole."""
        self._reserved.discard(adapter.name)
        self._register([adapter])

    def unload(self, name: str) -> LoraAdapter | None:
        """Takes `name` away; its slot is free now, or when its last request ends. None: unknown."""
        adapter = self._adapters.pop(name, None)
        if adapter is not None:
            if self._users.get(id(adapter)):
                self._draining[id(adapter)] = adapter
            metrics.lora_changed([], [name], len(self._adapters), self.resident_bytes())
        return adapter

    def acquire(self, name: str) -> LoraAdapter | None:
        """The adapter of `name`, counted as used by one more request until release()."""
        adapter = self._adapters.get(name)
        if adapter is not None:
            self._users[id(adapter)] = self._users.get(id(adapter), 0) + 1
        return adapter

    def release(self, adapter: LoraAdapter) -> None:
        left = self._users.get(id(adapter), 0) - 1
        if left > 0:
            self._users[id(adapter)] = left
            return
        self._users.pop(id(adapter), None)
        if self._draining.pop(id(adapter), None) is not None:
            metrics.lora_changed([], [], len(self._adapters), self.resident_bytes())

    def users(self, name: str) -> int:
        adapter = self._adapters.get(name)
        return self._users.get(id(adapter), 0) if adapter is not None else 0

    def _check_room(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            if name in self._adapters or name in self._reserved:
                raise Duplicate(f"The lora adapter {name!r} has already been loaded; unload it first or pick "
                                f"another name")
            if name == self.base_name:
                raise Duplicate(f"LoRA adapter name {name!r} is the base model's; pick another name")
        if self.slots_used() + len(names) > self.max_loras:
            draining = f" ({len(self._draining)} unloaded but still used by running requests)" if self._draining else ""
            raise SlotsFull(f"{self.slots_used() + len(names)} LoRA adapters{draining}, more than --max-loras "
                            f"{self.max_loras}; unload one or raise the flag (each slot is counted in the pool's "
                            f"sizing)")

    def _register(self, adapters: Iterable[LoraAdapter]) -> None:
        adapters = list(adapters)
        for adapter in adapters:
            self._adapters[adapter.name] = adapter
        metrics.lora_changed([a.name for a in adapters], [], len(self._adapters), self.resident_bytes())

    def is_current(self, adapter: LoraAdapter) -> bool:
        """Whether `adapter` is still loaded under its name (its metric series exist)."""
        return self._adapters.get(adapter.name) is adapter
