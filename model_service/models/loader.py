"""`--model tiny|PATH` -> a model in eval mode on its device, its config and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from model_service.models.config import ModelConfig, ModelLoadError
from model_service.models.llama import AttentionFn, LlamaForCausalLM, default_attention
from model_service.models.packed_linear import pack_linears
from model_service.models.tiny import build_tiny_model, tiny_config
from model_service.models.weights import checkpoint_files, load_weights
from model_service.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TINY_SPEC = "tiny"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    model_id: str


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attention: AttentionFn | None = None,
    attention_backend: str = "auto",
) -> LoadedModel:
    """spec: "tiny", or a local Hugging Face checkpoint directory (config.json,
    tokenizer.json, model.safetensors or a sharded model.safetensors.index.json).
    bfloat16 linears on CPU come back with their weights packed for oneDNN (packed_linear.py)."""
    loaded = _load_unpacked(spec, dtype, device, attention=attention, attention_backend=attention_backend)
    pack_linears(loaded.model)
    return loaded


def _load_unpacked(
    spec: str,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    attention: AttentionFn | None,
    attention_backend: str,
) -> LoadedModel:
    log = structlog.get_logger()
    if spec == TINY_SPEC:
        model = build_tiny_model(dtype, device, attention=attention, attention_backend=attention_backend)
        return LoadedModel(model, tiny_config(), ByteTokenizer(), TINY_SPEC)

    directory = Path(spec).expanduser()
    if not directory.is_dir():
        raise ModelLoadError(
            f"model {spec!r} is neither 'tiny' nor an existing checkpoint directory "
            "(nothing is downloaded: give a local path)"
        )
    config = ModelConfig.from_hf_dir(directory)
    tokenizer = HFTokenizer.from_dir(directory, config.eos_token_ids, config.bos_token_id)
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        config = _with_eos(config, tokenizer.eos_token_ids)
    checkpoint_files(directory)  # fail on absent weights before allocating anything
    if attention is None:
        attention = default_attention(attention_backend)  # outside the meta context below

    # Built on the meta device: no memory and no random init for weights that are
    # about to be overwritten; then materialized (uninitialized) on the target device.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention=attention)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared params
    load_weights(model, directory)
    model.rotary.reset_cache(device=device, dtype=dtype)
    log.info(
        "model loaded", path=str(directory), architecture=config.architecture, layers=config.num_layers,
        dtype=str(dtype), device=str(device),
    )
    return LoadedModel(model.eval().requires_grad_(False), config, tokenizer, str(directory))


def _with_eos(config: ModelConfig, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos_token_ids)
