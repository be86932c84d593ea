"""Offline sizing calculator: how many KV blocks a model would get on a device of a given size.

    python -m cache_service sizing --config path/to/config.json --memory 80GiB --dtype bfloat16

It applies the same formula as the live service (cache_service.core.sizing.size_pool) to a
Hugging Face config.json, with free memory taken as total − weights − workspace. The
live service measures free memory after the model's warmup instead, so its answer is
the one that counts; this one is for planning.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from cache_service.core.sizing import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HEADROOM,
    DEFAULT_MEMORY_FRACTION,
    SizingError,
    size_pool,
)
from pagedkv.kv_geometry import KvGeometry, dtype_from_name
from pagedkv.kv_geometry import kv_cache_dtype as kv_cache_dtype_of
from pagedkv.lora_slots import RANK_CEILING, largest_adapter_bytes
from pagedkv.units import format_bytes, parse_bytes


class ConfigError(ValueError):
    """config.json is missing, unreadable or lacks a field the sizing needs."""


def load_config(path: str | Path) -> dict:
    """A config.json, or a checkpoint directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    # Multimodal checkpoints keep the language model's config in text_config.
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    return config


def _require(config: dict, name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json needs a positive integer {name!r}, got {value!r}")
    return value


def geometry_from_config(config: dict, dtype_name: str, device: str, kv_cache_dtype: str = "auto") -> KvGeometry:
    """num_hidden_layers; num_key_value_heads (default num_attention_heads); head_dim
    (default hidden_size // num_attention_heads); the pool's dtype is kv_cache_dtype
    ("auto": dtype_name, the weights' dtype, as the model service does)."""
    num_heads = _require(config, "num_attention_heads")
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or _require(config, "hidden_size") // num_heads
    return KvGeometry(
        num_layers=_require(config, "num_hidden_layers"),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_cache_dtype_of(kv_cache_dtype, dtype_from_name(dtype_name)),
        device=device,
    )


def estimate_parameters(config: dict) -> int:
    """An estimate of a Llama-family (Llama, Mistral, Qwen2, Mixtral) model's parameters.

    Counted: the embedding; per layer q/k/v/o projections (with biases when
    attention_bias is set, or for Qwen2's q/k/v), the gate/up/down MLP (times
    num_local_experts, plus the router, for mixture-of-experts), two RMSNorms; the final
    norm; lm_head unless tie_word_embeddings. Not counted: anything architecture-specific
    beyond that (vision towers, extra norms), so treat it as an estimate and pass
    --weights-bytes when the real size is known.
    """
    hidden = _require(config, "hidden_size")
    vocab = _require(config, "vocab_size")
    num_layers = _require(config, "num_hidden_layers")
    num_heads = _require(config, "num_attention_heads")
    intermediate = _require(config, "intermediate_size")
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim

    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.get("attention_bias"):
        attention += q_width + 2 * kv_width + hidden
    elif config.get("model_type") == "qwen2":
        attention += q_width + 2 * kv_width
    experts = config.get("num_local_experts") or 1
    mlp = experts * 3 * hidden * intermediate
    if config.get("mlp_bias"):
        mlp += experts * (2 * intermediate + hidden)
    if experts > 1:
        mlp += hidden * experts  # router
    per_layer = attention + mlp + 2 * hidden
    embedding = vocab * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return embedding + num_layers * per_layer + hidden + lm_head


def lora_slots_of(config: dict, max_loras: int, max_rank: int, element_bytes: int) -> int:
    """--max-loras adapters of rank --max-lora-rank on every projection (none loaded offline)."""
    if max_loras < 0 or not 1 <= max_rank <= RANK_CEILING:
        raise ValueError(f"--max-loras must be 0 or more and --max-lora-rank 1 to {RANK_CEILING}, "
                         f"got {max_loras} and {max_rank}")
    if not max_loras:
        return 0
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return max_loras * largest_adapter_bytes(
        num_layers=config["num_hidden_layers"], hidden_size=hidden, intermediate_size=config["intermediate_size"],
        q_size=heads * head_dim, kv_size=kv_heads * head_dim, max_rank=max_rank, element_bytes=element_bytes)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cache_service sizing",
        description="How many KV blocks (and tokens) a model gets on a device, with every term explained.",
    )
    parser.add_argument("--config", required=True, help="a Hugging Face config.json, or the checkpoint directory")
    parser.add_argument("--memory", required=True, type=parse_bytes, help="device memory in all, e.g. 80GiB")
    parser.add_argument("--dtype", default=None,
                        help="weight (and KV) dtype: float32, float16, bfloat16 (default: config's torch_dtype, else bfloat16)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV pool dtype, as the model service's flag: auto (the --dtype), float32, bfloat16, "
                             "float16, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens a block (default 16)")
    parser.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION,
                        help="share of the memory the services may use (default 0.9)")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help="share of the budget left unallocated (default 0.05)")
    parser.add_argument("--weights-bytes", default="auto",
                        help="bytes of weights, e.g. 16GB, or 'auto' to estimate from the config (default)")
    parser.add_argument("--workspace-bytes", type=parse_bytes, default=0,
                        help="activation workspace the warmup would keep (default 0: not known offline)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (default: max_position_embeddings)")
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=None,
                        help="KV budget in bytes: the budget on cpu, a cap on cuda")
    parser.add_argument("--max-blocks", type=int, default=None, help="cap on the number of blocks")
    parser.add_argument("--max-loras", type=int, default=0,
                        help="LoRA adapter slots, as the model service's flag (default 0: no adapters)")
    parser.add_argument("--max-lora-rank", type=int, default=64,
                        help="the largest LoRA rank each slot is sized for (default 64)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """0 with the report printed; 2 with a message on stderr for bad input or too little memory."""
    try:
        args = _parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:  # argparse has printed usage and the error
        return int(exit_.code or 0)
    try:
        config = load_config(args.config)
        dtype_name = args.dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        geometry = geometry_from_config(config, dtype_name, args.device, args.kv_cache_dtype)
        weight_dtype_bytes = dtype_from_name(dtype_name).itemsize
        max_model_len = args.max_model_len or config.get("max_position_embeddings")
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ConfigError("config.json has no max_position_embeddings: pass --max-model-len")

        if args.weights_bytes == "auto":
            parameters = estimate_parameters(config)
            weights_bytes = parameters * weight_dtype_bytes
            weights_sentence = (
                f"weights ≈ {format_bytes(weights_bytes)}: an estimate from config.json "
                f"({parameters:,} parameters × {weight_dtype_bytes} bytes); pass --weights-bytes for the real size"
            )
        else:
            weights_bytes = parse_bytes(args.weights_bytes)
            weights_sentence = f"weights = {format_bytes(weights_bytes)} (--weights-bytes)"
        lora_slot_bytes = lora_slots_of(config, args.max_loras, args.max_lora_rank, weight_dtype_bytes)
        memory_free = args.memory - weights_bytes - args.workspace_bytes
        if memory_free < 0:
            raise SizingError(
                f"weights {format_bytes(weights_bytes)} + workspace {format_bytes(args.workspace_bytes)} "
                f"exceed --memory {format_bytes(args.memory)}: no room for a KV cache"
            )
        report = size_pool(
            geometry,
            block_size=args.block_size,
            memory_total=args.memory,
            memory_free=memory_free,
            memory_fraction=args.memory_fraction,
            headroom=args.headroom,
            workspace_bytes=args.workspace_bytes,
            max_model_len=max_model_len,
            kv_cache_bytes=args.kv_cache_bytes,
            max_blocks=args.max_blocks,
            weights_bytes=weights_bytes,
            lora_slot_bytes=lora_slot_bytes,
        )
    except (SizingError, ValueError) as error:  # ConfigError and bad flag values too
        print(f"sizing: error: {error}", file=sys.stderr)
        return 2

    notes = [weights_sentence, f"free memory = --memory − weights − workspace = {format_bytes(memory_free)} "
                               f"(offline estimate; the service measures it after warmup)"]
    report = replace(report, explanation=notes + report.explanation)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
