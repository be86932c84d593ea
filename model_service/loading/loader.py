"""`--model tiny|smollm2|PATH` -> a model in eval mode on its device, its config, its
tokenizer and its chat template.

PATH is a Hugging Face checkpoint directory (config.json, tokenizer.json, safetensors) or a
GGUF file (or a directory holding exactly one and no config.json)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
import torch

from model_service.text.chat_template import ChatTemplate
from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.loading.freed_memory import return_freed_memory
from model_service.loading.meta_build import SkipMetaInit, to_empty
from model_service.loading.embedded import EMBEDDED_MODELS, embedded_model_path
from model_service.loading.gguf_config import config_from_gguf
from model_service.loading.gguf_file import GGUFFile, is_gguf_spec, resolve_gguf_path
from model_service.loading.gguf_native import install_native, native_tensor_names, plan_native
from model_service.loading.gguf_tokenizer import tokenizer_from_gguf
from model_service.loading.gguf_weights import check_gguf_tensors, load_gguf_weights
from model_service.loading.hf_int8 import QUANTIZATIONS, install_int8
from model_service.models.llama import AttentionFn, LlamaForCausalLM, default_attention
from model_service.models.packed_linear import pack_linears
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from model_service.models.weights_held import weights_bytes_by_type
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
    # What the weights hold, by dtype or GGUF block type (weights_held.py): GetModelInfo
    # and Attach report it.
    weights_bytes_by_type: dict[str, int] = field(default_factory=dict)
    # How the weights compute when not as the checkpoint's floats ("weights=native",
    # "weights=int8"; "" when they do): the K/V they write differ, so server.py folds it
    # into the fingerprint that names this model's prefixes.
    weights_tag: str = ""


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attention: AttentionFn | None = None,
    attention_backend: str = "auto",
    weights: str = "dequantize",
    quantization: str = "none",
) -> LoadedModel:
    """spec: "tiny"; an embedded model ("smollm2"); a GGUF file (or a directory holding one);
    or a local Hugging Face checkpoint directory (config.json, tokenizer.json,
    model.safetensors or a sharded model.safetensors.index.json).
    weights: "native" keeps a GGUF file's quantized linears in their blocks on CPU where a
    kernel takes their type (gguf_native.py); "dequantize" converts every tensor to dtype.
    quantization: "int8" holds a Hugging Face checkpoint's linears and embedding as Q8_0
    blocks on CPU (hf_int8.py); refused (ValueError) on CUDA and for anything else.
    bfloat16 linears on CPU come back with their weights packed for oneDNN (packed_linear.py)."""
    check_quantization(spec, quantization, device)
    loaded = _load_unpacked(spec, dtype, device, attention=attention, attention_backend=attention_backend,
                            weights=weights, quantization=quantization)
    pack_linears(loaded.model)
    return_freed_memory()
    quantized = any(isinstance(module, (QuantizedLinear, QuantizedEmbedding)) for module in loaded.model.modules())
    if isinstance(loaded.model.lm_head, QuantizedLinear):
        # A row's logits must not depend on how many rows are computed with it: a step
        # samples from each sequence's last row alone, prompt logprobs from every row.
        loaded.model.lm_head.float_from = None
    tag = ("weights=int8" if quantization == "int8" else "weights=native") if quantized else ""
    return replace(loaded, weights_bytes_by_type=weights_bytes_by_type(loaded.model), weights_tag=tag)


def check_quantization(spec: str, quantization: str, device: str | torch.device) -> None:
    """--quantization int8 is for a Hugging Face checkpoint on CPU: a ValueError naming
    why not otherwise, before anything loads."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only (its kernels are CPU code); on "
                         f"{torch.device(device).type}, serve the checkpoint in --dtype bfloat16 instead")
    if spec == TINY_SPEC:
        raise ValueError(f"--quantization {quantization} is for Hugging Face checkpoints; 'tiny' is built in "
                         "process: write it as a checkpoint directory to quantize it")
    if spec in EMBEDDED_MODELS or is_gguf_spec(spec):
        raise ValueError(f"--quantization {quantization} is for Hugging Face checkpoints; {spec!r} is a GGUF "
                         "file, quantized already: --weights native keeps its own blocks")


def _load_unpacked(
    spec: str,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    attention: AttentionFn | None,
    attention_backend: str,
    weights: str = "dequantize",
    quantization: str = "none",
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
    files = checkpoint_files(directory)  # fail on absent weights before allocating anything
    quantized: set[str] = set()

    def quantize(meta_model) -> None:
        quantized.update(install_int8(meta_model, files, dtype))

    model = _materialize(config, dtype, device, attention, before_memory=quantize if quantization == "int8" else None)
    load_weights(model, directory, skip=quantized)
    return _loaded(model, config, tokenizer, str(directory), chat_template, dtype, device)


def gguf_text(file: GGUFFile, config: ModelConfig) -> tuple[HFTokenizer, ChatTemplate | None]:
    """A GGUF file's tokenizer and chat template (None: it has none), as the service uses
    them; no weights are read (bench/serve/bench_quantized.py renders its prompts with them)."""
    tokenizer = tokenizer_from_gguf(file, config.eos_token_ids, config.bos_token_id)
    source = file.value("tokenizer.chat_template")
    chat_template = None if not source else ChatTemplate(
        source, bos_token=tokenizer.token_text(config.bos_token_id),
        eos_token=tokenizer.token_text(next(iter(config.eos_token_ids), None)),
    )
    return tokenizer, chat_template


def _load_gguf(path: Path, model_id: str, dtype, device, attention, weights: str = "dequantize") -> LoadedModel:
    file = GGUFFile(path)
    config = config_from_gguf(file)
    tokenizer, chat_template = gguf_text(file, config)
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
    # Neither the build nor the materializing runs torch's Python meta kernels (meta_build.py).
    with torch.device("meta"), SkipMetaInit():
        model = LlamaForCausalLM(config, attention=attention)
    if before_memory is not None:
        before_memory(model)
    # In dtype while still on meta: materializing in float32 and converting after made
    # every weight twice on the way, a float32 copy beside each bfloat16 one at the load's peak.
    model = to_empty(model.to(dtype), device)
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
