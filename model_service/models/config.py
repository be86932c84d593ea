"""The model's shape, read from a Hugging Face config.json or built in-process (tiny).

One slotted dataclass that validates itself: everything downstream (weights, RoPE, the
KV geometry the cache service is attached with) reads its numbers from here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from model_service.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None (plain RoPE) or the Llama-3 frequency scaling: {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections (Qwen2: always; Llama: `attention_bias`).
    attention_bias: bool = False
    # Bias on o_proj (Llama's `attention_bias` covers it too; Qwen2 has none).
    o_proj_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Sliding-window attention: a token attends to the last `sliding_window` positions (its
    # own included) on the layers in sliding_window_layers (None: every layer, as Mistral).
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ModelLoadError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ModelLoadError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            missing = [key for key in _LLAMA3_ROPE_KEYS if key not in self.rope_scaling]
            if self.rope_scaling.get("rope_type") != "llama3" or missing:
                raise ModelLoadError(
                    f"rope_scaling must be None or llama3 with {', '.join(_LLAMA3_ROPE_KEYS)}; "
                    f"got {self.rope_scaling!r}"
                )
            if self.rope_scaling["high_freq_factor"] == self.rope_scaling["low_freq_factor"]:
                raise ModelLoadError("llama3 rope_scaling needs high_freq_factor != low_freq_factor")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.sliding_window is not None:
            if not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) \
                    or self.sliding_window <= 0:
                raise ModelLoadError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")
        if self.sliding_window_layers is not None:
            layers = tuple(int(i) for i in self.sliding_window_layers)
            if any(not 0 <= i < self.num_layers for i in layers):
                raise ModelLoadError(f"sliding_window_layers {layers} name layers outside 0..{self.num_layers - 1}")
            object.__setattr__(self, "sliding_window_layers", layers)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of this layer, or None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json for eos ids, when present)."""
        directory = Path(path)
        config_path = directory / "config.json"
        raw = _read_json(config_path, required=True)
        generation = _read_json(directory / "generation_config.json", required=False) or {}
        return cls.from_hf_dict(raw, generation, source=str(config_path))

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, *, source: str = "config.json"
    ) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError(
                f"{source} names no architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden_size = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
            head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
            fields = dict(
                vocab_size=int(raw["vocab_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            )
        except KeyError as missing:
            raise ModelLoadError(f"{source} lacks required field {missing}") from None

        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} unsupported (only silu)")
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{source}: mlp_bias=true is unsupported")
        if architecture == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(raw.get("attention_bias", False))

        rope_theta, rope_scaling = _parse_rope(raw, source)
        sliding_window, sliding_window_layers = _parse_sliding_window(raw, architecture, source)

        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids: tuple[int, ...] = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        bos = generation.get("bos_token_id", raw.get("bos_token_id"))

        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            sliding_window=sliding_window,
            sliding_window_layers=sliding_window_layers,
            **fields,
        )


def _parse_sliding_window(
    raw: dict[str, Any], architecture: str, source: str
) -> tuple[int | None, tuple[int, ...] | None]:
    """The window and the layers it applies to, as transformers applies them.

    Mistral: `sliding_window` (null: none) on every layer. Qwen2: only with
    `use_sliding_window`, on the layers `layer_types` marks "sliding_attention", or without
    layer_types on layers max_window_layers and up. Llama has no sliding window.
    """
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM" or window is None:
        return None, None
    if architecture == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window"):
            return None, None
        num_layers = int(raw["num_hidden_layers"])
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        else:
            first = int(raw.get("max_window_layers", 28))
            layers = tuple(range(first, num_layers))
    else:
        layers = None
    if isinstance(window, bool) or not isinstance(window, int):
        raise ModelLoadError(f"{source}: sliding_window must be an integer or null, got {window!r}")
    if layers == ():
        return None, None  # no layer slides (Qwen2 with max_window_layers >= the layer count)
    structlog.get_logger().info(
        "sliding window attention", sliding_window=window, layers="all" if layers is None else list(layers),
        source=source,
    )
    return window, layers


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Accept both spellings: `rope_theta` + `rope_scaling` (most checkpoints) and
    `rope_parameters` (what transformers 5 writes)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    if scaling:
        params.update(scaling)
    rope_theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in params]
    if missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    scaling_params = {"rope_type": "llama3"}
    scaling_params.update({key: float(params[key]) for key in _LLAMA3_ROPE_KEYS})
    scaling_params["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return rope_theta, scaling_params


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"missing {path.name} in {path.parent}")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {path}: {error}") from None
