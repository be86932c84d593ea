"""The adapters a server holds, by the name requests use for them.

`--lora-modules NAME=PATH` is read whole at start: every adapter is loaded and checked
before any is registered, so a bad one stops the start with its message and none is
half-served.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import torch

from model_service.lora.peft_adapter import AdapterError, LoraAdapter, load_adapter, max_adapter_bytes
from model_service.models.config import ModelConfig
from pagedkv.lora_slots import RANK_CEILING

# Names travel in the OpenAI `model` field, URLs and metric labels.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 64


def parse_lora_module(text: str) -> tuple[str, str]:
    """'NAME=PATH' -> (name, path); raises AdapterError naming the expected form."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise AdapterError(f"--lora-modules {text!r}: expected NAME=PATH (the directory peft's "
                           f"save_pretrained wrote)")
    if not _NAME.match(name):
        raise AdapterError(f"--lora-modules {text!r}: the name must be 1-128 letters, digits or ._:/- "
                           f"and start with a letter or digit")
    return name, path


class LoraRegistry:
    """Up to max_loras adapters by name, each of rank at most max_rank."""

    def __init__(self, config: ModelConfig, *, max_loras: int = DEFAULT_MAX_LORAS,
                 max_rank: int = DEFAULT_MAX_LORA_RANK, base_name: str | None = None) -> None:
        if max_loras < 0:
            raise ValueError(f"--max-loras must be 0 (no adapters) or more, got {max_loras}")
        if not 1 <= max_rank <= RANK_CEILING:
            raise ValueError(f"--max-lora-rank must be between 1 and {RANK_CEILING}, got {max_rank}")
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.base_name = base_name
        self._adapters: dict[str, LoraAdapter] = {}

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """What max_loras adapters of the largest allowed rank hold in `dtype` (the pool's
        sizing); 0 while no adapter is loaded: LoRA is off and reserves nothing."""
        if not self._adapters:
            return 0
        return self.max_loras * max_adapter_bytes(self.config, self.max_rank, dtype.itemsize)

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

    def _check_room(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            if name in self._adapters:
                raise AdapterError(f"LoRA adapter {name!r} is loaded already; unload it first or pick another name")
            if name == self.base_name:
                raise AdapterError(f"LoRA adapter name {name!r} is the base model's; pick another name")
        if len(self._adapters) + len(names) > self.max_loras:
            raise AdapterError(f"{len(self._adapters) + len(names)} LoRA adapters, more than --max-loras "
                               f"{self.max_loras}; raise the flag (each slot is counted in the pool's sizing)")

    def _register(self, adapters: Iterable[LoraAdapter]) -> None:
        for adapter in adapters:
            self._adapters[adapter.name] = adapter
