"""A PEFT-format LoRA adapter read from its directory (adapter_config.json +
adapter_model.safetensors) and checked against the base model before anything of it is kept.

Every check runs before the adapter exists: a bad adapter raises AdapterError with what is
wrong and what to do, and no tensor of it is held anywhere. The adapter's identity is a
digest of its weights and scaling, not of its name or path: the same file under another
name serves (and caches) the same K/V.

Only what serves LoRA on the plain projections is accepted: no DoRA, no per-module rank or
alpha patterns, no biases or modules_to_save (each would change more than x·A·B), and never
a pickled adapter_model.bin (unpickling runs code).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model_service.models.config import ModelConfig
from pagedkv.lora_slots import largest_adapter_bytes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A real adapter_config.json is a few kilobytes; a larger one is not read.
MAX_CONFIG_BYTES = 1 << 20
# The safetensors header (tensor names, shapes, offsets) of an adapter over every target of a
# deep model is tens of kilobytes; past this the file is refused before its header is parsed.
MAX_HEADER_BYTES = 16 << 20
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served, with the reason and the fix in the message."""


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, config.q_size), "k_proj": (hidden, config.kv_size),
            "v_proj": (hidden, config.kv_size), "o_proj": (config.q_size, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def max_adapter_bytes(config: ModelConfig, max_rank: int, element_bytes: int = 4) -> int:
    """Bytes of the largest adapter allowed: rank max_rank on every target of every layer."""
    return largest_adapter_bytes(num_layers=config.num_layers, hidden_size=config.hidden_size,
                                 intermediate_size=config.intermediate_size, q_size=config.q_size,
                                 kv_size=config.kv_size, max_rank=max_rank, element_bytes=element_bytes)


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One projection's factors: delta(x) = scaling · (x @ a.T) @ b.T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


# Weak references: models/lora_tables.py keeps each adapter's table of factor addresses
# for as long as the adapter lives.
@dataclass(frozen=True, slots=True, weakref_slot=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # hex sha256 of the weights file and the scaling
    # (layer index, target) -> factors; a layer or target the adapter leaves out is absent.
    weights: dict[tuple[int, str], LoraWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                   for w in self.weights.values())

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in TARGETS if any(key[1] == t for key in self.weights))


def load_adapter(name: str, path: str | os.PathLike, config: ModelConfig, *, max_rank: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraAdapter:
    """Reads and checks the adapter at `path` for a base of `config`; raises AdapterError."""
    directory = Path(path)
    where = f"LoRA adapter {name!r} at {str(directory)!r}"
    if not directory.is_dir():
        raise AdapterError(f"{where}: not a directory; --lora-modules NAME=PATH takes the directory "
                           f"that holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    settings = _read_config(directory / CONFIG_FILE, where, max_rank)
    rank, scaling = settings["rank"], settings["scaling"]
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        hint = (" (only adapter_model.bin, a pickle, which is never loaded: convert it with "
                "safetensors' convert script or save_pretrained(safe_serialization=True))"
                if (directory / "adapter_model.bin").exists() else "")
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is missing{hint}")
    _check_header_size(weights_path, where, max_adapter_bytes(config, max_rank))
    shapes = target_shapes(config)
    weights = _read_weights(weights_path, where, config, shapes, rank, settings["targets"], dtype, device)
    digest = hashlib.sha256()
    with open(weights_path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    digest.update(f"|scaling={scaling!r}".encode())
    return LoraAdapter(name=name, path=str(directory), rank=rank, scaling=scaling, digest=digest.hexdigest(),
                       weights=weights)


def _read_config(path: Path, where: str, max_rank: int) -> dict:
    if not path.is_file():
        raise AdapterError(f"{where}: {CONFIG_FILE} is missing; save the adapter with peft's save_pretrained")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: {CONFIG_FILE} is {path.stat().st_size} bytes, more than a config "
                           f"holds (at most {MAX_CONFIG_BYTES})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {raw.get('peft_type')!r} is not served; only LORA adapters are")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{where}: {CONFIG_FILE} field r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}; raise the flag "
                           f"(adapter memory grows with it) or use a smaller adapter")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{where}: {CONFIG_FILE} field lora_alpha must be a positive number, got {alpha!r}")
    for field, why in (("use_dora", "DoRA rescales the base weight"),
                       ("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                       ("modules_to_save", "fully trained copies of base modules"),
                       ("layer_replication", "replicated layers")):
        if raw.get(field):
            raise AdapterError(f"{where}: {field} is set ({why}), which is not served; merge it into a "
                               f"checkpoint of its own instead")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {raw.get('bias')!r} trains base biases, which is not served; "
                           f"only bias 'none' adapters are")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        # peft takes a string as a regex over full module names; "all-linear" is its shorthand.
        targets = list(TARGETS) if targets == "all-linear" else \
            [t for t in TARGETS if re.search(targets, f"model.layers.0.self_attn.{t}")
             or re.search(targets, f"model.layers.0.mlp.{t}")]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: {CONFIG_FILE} field target_modules must list the projections it trains")
    unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
    if unknown:
        raise AdapterError(f"{where}: target_modules {unknown} are not served; LoRA applies to "
                           f"{', '.join(TARGETS)}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return {"rank": rank, "scaling": float(scaling), "targets": {t.rsplit(".", 1)[-1] for t in targets}}


def _check_header_size(path: Path, where: str, max_payload: int) -> None:
    """Refuses a file whose header or size no adapter of the allowed ranks has, before the
    safetensors parser reads (and allocates for) its header."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
    if len(prefix) < 8:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is truncated ({size} bytes); copy it again")
    header_len = int.from_bytes(prefix, "little")
    if header_len > MAX_HEADER_BYTES:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} declares a {header_len}-byte header, more than any "
                           f"adapter's (at most {MAX_HEADER_BYTES}); the file is corrupt")
    if 8 + header_len > size:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is truncated (header runs past its {size} bytes); copy it again")
    if size - 8 - header_len > max_payload:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds {size - 8 - header_len} bytes of tensors, more than an "
                           f"adapter of --max-lora-rank over every target of this model ({max_payload})")


def _read_weights(path: Path, where: str, config: ModelConfig, shapes: dict[str, tuple[int, int]], rank: int,
                  targets: set[str], dtype: torch.dtype, device: torch.device | str,
                  ) -> dict[tuple[int, str], LoraWeights]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as tensors:
            for key in tensors.keys():
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"{where}: tensor {key!r} is not a LoRA factor of a served projection "
                                       f"({', '.join(TARGETS)}); such adapters are not served")
                layer, target, half = int(match[1]), match[2], match[3]
                if target not in shapes:
                    raise AdapterError(f"{where}: tensor {key!r} targets {target!r}, which is not served; "
                                       f"LoRA applies to {', '.join(TARGETS)}")
                if target not in targets:
                    raise AdapterError(f"{where}: tensor {key!r} targets {target!r}, which target_modules "
                                       f"does not list; the config and weights disagree")
                if layer >= config.num_layers:
                    raise AdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the base model has "
                                       f"{config.num_layers} layers; the adapter was trained on another base")
                tensor = tensors.get_tensor(key)
                fan_in, fan_out = shapes[target]
                want = (rank, fan_in) if half == "A" else (fan_out, rank)
                if tuple(tensor.shape) != want:
                    raise AdapterError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}, the base model "
                                       f"and rank {rank} need {want}; the adapter was trained on another base")
                if tensor.dtype not in WEIGHT_DTYPES:
                    raise AdapterError(f"{where}: tensor {key!r} is {tensor.dtype}; adapters in float32, float16 "
                                       f"or bfloat16 are served")
                if not torch.isfinite(tensor).all():
                    raise AdapterError(f"{where}: tensor {key!r} holds NaN or infinite values")
                halves.setdefault((layer, target), {})[half] = tensor.to(device=device, dtype=dtype)
    except SafetensorError as error:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} cannot be read ({error}); the file is truncated or "
                           f"corrupt, copy it again") from None
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{where}: layer {layer} {target} has no {missing}; the file is incomplete")
        weights[(layer, target)] = LoraWeights(a=pair["A"].contiguous(), b=pair["B"].contiguous())
    if not weights:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA factors")
    return weights
