"""The KV shape of a model: what one token costs in the pool. Shared by both services."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pagedkv.cache.v1 import cache_pb2

# The dtypes a pool may hold, by the names people, Hugging Face configs and vLLM's
# --kv-cache-dtype use. The 8-bit ones hold K/V divided by a per-layer scale
# (attention/kv_quant.py); "fp8" alone is e4m3, as in vLLM.
_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_NAME_ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                                 "bf16": "bfloat16", "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
                                 "float8_e5m2": "fp8_e5m2"}
_NAMES_BY_DTYPE: dict[torch.dtype, str] = {value: key for key, value in _DTYPES_BY_NAME.items()}
_DTYPE_TO_PROTO: dict[torch.dtype, int] = {
    torch.float32: cache_pb2.DTYPE_FLOAT32,
    torch.float16: cache_pb2.DTYPE_FLOAT16,
    torch.bfloat16: cache_pb2.DTYPE_BFLOAT16,
    torch.float8_e4m3fn: cache_pb2.DTYPE_FLOAT8_E4M3,
    torch.float8_e5m2: cache_pb2.DTYPE_FLOAT8_E5M2,
}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
_PROTO_TO_DTYPE: dict[int, torch.dtype] = {value: key for key, value in _DTYPE_TO_PROTO.items()}
_DEVICE = re.compile(r"^(cpu|cuda|cuda:[0-9]+)$")

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_DTYPES_BY_NAME)


def dtype_from_name(name: str) -> torch.dtype:
    """"bfloat16" (or "bf16", "torch.bfloat16") -> torch.bfloat16; ValueError otherwise."""
    key = name.strip().lower().removeprefix("torch.")
    key = _NAME_ALIASES.get(key, key)
    if key not in _DTYPES_BY_NAME:
        raise ValueError(f"unsupported KV dtype {name!r}; use one of {', '.join(SUPPORTED_DTYPES)}")
    return _DTYPES_BY_NAME[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"; torch.float8_e4m3fn -> "fp8_e4m3"."""
    return _NAMES_BY_DTYPE[check_dtype(dtype)]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def copyable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or for an 8-bit float one a uint8 view of its bytes: index_copy_ has no
    8-bit float kernel on CPU (torch 2.13), and every block copy (forks, tiers) is bytes."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the compute dtype (the pool as it always was)."""
    return compute_dtype if name.strip().lower() == "auto" else dtype_from_name(name)


def check_dtype(dtype: object) -> torch.dtype:
    if dtype not in _DTYPE_TO_PROTO:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {', '.join(SUPPORTED_DTYPES)}")
    return dtype  # type: ignore[return-value]


def dtype_to_proto(dtype: torch.dtype) -> int:
    """torch.bfloat16 -> cache_pb2.DTYPE_BFLOAT16."""
    return _DTYPE_TO_PROTO[check_dtype(dtype)]


def dtype_from_proto(value: int) -> torch.dtype:
    """cache_pb2.DTYPE_BFLOAT16 -> torch.bfloat16; ValueError for DTYPE_UNSPECIFIED or unknown."""
    if value not in _PROTO_TO_DTYPE:
        label = "DTYPE_UNSPECIFIED" if value == cache_pb2.DTYPE_UNSPECIFIED else f"unknown DType {value}"
        raise ValueError(f"dtype is {label}; set one of DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16, "
                         f"DTYPE_FLOAT8_E4M3, DTYPE_FLOAT8_E5M2")
    return _PROTO_TO_DTYPE[value]


def check_device(device: str) -> str:
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    return device


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """num_layers × (K, V) × num_kv_heads × head_dim of one dtype, on one device."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"geometry {field} must be a positive integer, got {value!r}")
        check_dtype(self.dtype)
        check_device(self.device)

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        """2 (K and V) × num_layers × block_size × num_kv_heads × head_dim × dtype_bytes."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return block_size * self.bytes_per_token

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (docs/architecture.md, "Pool layout")."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def to_proto(self) -> cache_pb2.Geometry:
        return cache_pb2.Geometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype_to_proto(self.dtype),
            device=self.device,
        )

    @classmethod
    def from_proto(cls, geometry: cache_pb2.Geometry) -> KvGeometry:
        """Raises ValueError naming the field for zeros, DTYPE_UNSPECIFIED or a bad device."""
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(geometry, field) == 0:
                raise ValueError(f"geometry {field} is 0 (unset); it must be a positive integer")
        if not geometry.device:
            raise ValueError("geometry device is empty (unset); use 'cpu', 'cuda' or 'cuda:N'")
        return cls(
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            dtype=dtype_from_proto(geometry.dtype),
            device=geometry.device,
        )
