"""`--model tiny|smollm2|PATH` -> a model in eval mode on its device, its config, its
tokenizer and its chat template.

PATH is a Hugging Face checkpoint directory (config.json, tokenizer.json, safetensors) or a
GGUF file (or a directory holding exactly one and no config.json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from model_service.text.chat_template import ChatTemplate
from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.loading.embedded import EMBEDDED_MODELS, embedded_model_path
from model_service.loading.gguf_config import config_from_gguf
from model_service.loading.gguf_file import GGUFFile, is_gguf_spec, resolve_gguf_path
from model_service.loading.gguf_native import install_native, native_tensor_names, plan_native
from model_service.loading.gguf_tokenizer import tokenizer_from_gguf
from model_service.loading.gguf_weights import check_gguf_tensors, load_gguf_weights
from model_service.models.llama import AttentionFn, LlamaForCausalLM, default_attention
from model_service.models.packed_linear import pack_linears
from model_service.loading.tiny import build_tiny_model, tiny_config
from model_service.loading.hf_weights import checkpoint_files, load_weights
from model_service.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, special_tokens_from_config

TINY_SPEC = "tiny"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    model_id: str
    # None: the checkpoint has none, and GenerateRequest.messages is refused.
    chat_template: ChatTemplate | None = None


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attention: AttentionFn | None = None,
    attention_backend: str = "auto",
    weights: str = "dequantize",
) -> LoadedModel:
    """spec: "tiny"; an embedded model ("smollm2"); a GGUF file (or a directory holding one);
    or a local Hugging Face checkpoint directory (config.json, tokenizer.json,
    model.safetensors or a sharded model.safetensors.index.json).
    weights: "native" keeps a GGUF file's quantized linears in their blocks on CPU where a
    kernel takes their type (gguf_native.py); "dequantize" converts every tensor to dtype.
    bfloat16 linears on CPU come back with their weights packed for oneDNN (packed_linear.py)."""
    loaded = _load_unpacked(spec, dtype, device, attention=attention, attention_backend=attention_backend,
                            weights=weights)
    pack_linears(loaded.model)
    return loaded


def _load_unpacked(
    spec: str,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    attention: AttentionFn | None,
    attention_backend: str,
    weights: str = "dequantize",
) -> LoadedModel:
    if attention is None and spec != TINY_SPEC:
        attention = default_attention(attention_backend)  # outside the meta context of _materialize
    if spec == TINY_SPEC:
        model = build_tiny_model(dtype, device, attention=attention, attention_backend=attention_backend)
        return LoadedModel(model, tiny_config(), ByteTokenizer(), TINY_SPEC)
    if spec in EMBEDDED_MODELS:
        return _load_gguf(embedded_model_path(spec), spec, dtype, device, attention, weights)
    if is_gguf_spec(spec):
        path = resolve_gguf_path(spec)
        return _load_gguf(path, str(path), dtype, device, attention, weights)

    directory = Path(spec).expanduser()
    if not directory.is_dir():
        known = ", ".join(repr(name) for name in (TINY_SPEC, *EMBEDDED_MODELS))
        raise ModelLoadError(
            f"model {spec!r} is not {known}, a .gguf file or an existing checkpoint directory "
            "(nothing is downloaded: give a local path)"
        )
    config = ModelConfig.from_hf_dir(directory)
    tokenizer = HFTokenizer.from_dir(directory, config.eos_token_ids, config.bos_token_id)
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        config = _with_eos(config, tokenizer.eos_token_ids)
    special = special_tokens_from_config(directory / "tokenizer_config.json")
    chat_template = ChatTemplate.from_hf_dir(directory, bos_token=special.get("bos_token"),
                                             eos_token=special.get("eos_token"))
    checkpoint_files(directory)  # fail on absent weights before allocating anything
    model = _materialize(config, dtype, device, attention)
    load_weights(model, directory)
    return _loaded(model, config, tokenizer, str(directory), chat_template, dtype, device)


def _load_gguf(path: Path, model_id: str, dtype, device, attention, weights: str = "dequantize") -> LoadedModel:
    file = GGUFFile(path)
    config = config_from_gguf(file)
    tokenizer = tokenizer_from_gguf(file, config.eos_token_ids, config.bos_token_id)
    source = file.value("tokenizer.chat_template")
    chat_template = None if not source else ChatTemplate(
        source, bos_token=tokenizer.token_text(config.bos_token_id),
        eos_token=tokenizer.token_text(next(iter(config.eos_token_ids), None)),
    )
    check_gguf_tensors(file, config)  # fail on a wrong file before allocating anything
    native = plan_native(file, config, weights, device)
    model = _materialize(config, dtype, device, attention,
                         before_memory=lambda meta_model: install_native(meta_model, file, native, dtype))
    load_gguf_weights(model, file, skip=native_tensor_names(native))
    return _loaded(model, config, tokenizer, model_id, chat_template, dtype, device)


def _materialize(config: ModelConfig, dtype, device, attention, before_memory=None) -> LlamaForCausalLM:
    # Built on the meta device: no memory and no random init for weights that are
    # about to be overwritten; then materialized (uninitialized) on the target device.
    # before_memory(model) may swap modules first (quantized ones, which hold their own).
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention=attention)
    if before_memory is not None:
        before_memory(model)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings and isinstance(model.embed_tokens, torch.nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared params
    return model


def _loaded(model, config, tokenizer, model_id, chat_template, dtype, device) -> LoadedModel:
    model.rotary.reset_cache(device=device, dtype=dtype)
    structlog.get_logger().info(
        "model loaded", path=model_id, architecture=config.architecture, layers=config.num_layers,
        dtype=str(dtype), device=str(device), chat_template=chat_template is not None,
    )
    return LoadedModel(model.eval().requires_grad_(False), config, tokenizer, model_id, chat_template)


def _with_eos(config: ModelConfig, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos_token_ids)
