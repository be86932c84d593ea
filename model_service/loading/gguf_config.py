"""ModelConfig from a GGUF file's metadata (llama.cpp's key names, `{arch}.*` and `tokenizer.ggml.*`).

A GGUF has no config.json: its metadata is the config. Every number is read from the file;
what the file cannot express for pagedkv (partial rotary, per-layer head counts, RoPE
scaling) is a load error naming it, never a silent default.
"""

from __future__ import annotations

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.loading.gguf_file import GGUFFile

# GGUF architecture -> the ModelConfig architecture serving it. llama.cpp writes Llama,
# Mistral and SmolLM checkpoints all as "llama".
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# The RoPE table holds a row per position (rope.py), allocated at load: a file claiming
# billions of positions must not allocate them. 4M is past every released model's context.
MAX_CONTEXT_LENGTH = 1 << 22
# Tensors that would change the model's arithmetic in ways pagedkv does not implement.
_UNSUPPORTED_TENSORS = {
    "rope_freqs.weight": "per-dimension RoPE frequency factors (Llama 3.1-style RoPE scaling in GGUF)",
}


def config_from_gguf(file: GGUFFile) -> ModelConfig:
    architecture = file.architecture
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{file.path}: GGUF architecture {architecture!r} is unsupported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    for name, what in _UNSUPPORTED_TENSORS.items():
        if name in file.tensors:
            raise ModelLoadError(f"{file.path} has {name}: {what} is unsupported")

    def key(name: str) -> str:
        return f"{architecture}.{name}"

    hidden_size = _positive(file, key("embedding_length"), int(file.require(key("embedding_length"))))
    num_heads = _positive(file, key("attention.head_count"), _one_count(file, key("attention.head_count")))
    num_kv_heads = _one_count(file, key("attention.head_count_kv"), default=num_heads)
    head_dim = int(file.value(key("attention.key_length"), hidden_size // num_heads))
    value_dim = int(file.value(key("attention.value_length"), head_dim))
    rotary_dim = int(file.value(key("rope.dimension_count"), head_dim))
    if value_dim != head_dim or rotary_dim != head_dim:
        raise ModelLoadError(
            f"{file.path}: key length {head_dim}, value length {value_dim} and RoPE dimension {rotary_dim} "
            "must be equal (partial rotary and distinct value heads are unsupported)"
        )
    _check_rope_scaling(file, key)

    tokens = file.value("tokenizer.ggml.tokens")
    vocab_size = file.value(key("vocab_size"))
    if vocab_size is None:
        if tokens is None:
            raise ModelLoadError(f"{file.path} states neither {key('vocab_size')} nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    eos = file.value("tokenizer.ggml.eos_token_id")
    # Chat models often end a turn with a token of their own (Llama 3's <|eot_id|>).
    eot = file.value("tokenizer.ggml.eot_token_id")
    eos_token_ids = tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None))
    bos = file.value("tokenizer.ggml.bos_token_id")
    # Checked here: a tokenizer indexes its token list with them.
    tokens_known = len(tokens) if tokens is not None else int(vocab_size)
    for name, token_id in (("bos_token_id", bos), ("eos_token_id", eos), ("eot_token_id", eot)):
        if token_id is not None and not 0 <= int(token_id) < min(tokens_known, int(vocab_size)):
            raise ModelLoadError(f"{file.path}: tokenizer.ggml.{name} {int(token_id)} is not a token id of its "
                                 f"{min(tokens_known, int(vocab_size)):,} tokens")
    context_length = int(file.value(key("context_length"), 2048))
    if context_length > MAX_CONTEXT_LENGTH:
        raise ModelLoadError(f"{file.path}: {key('context_length')} {context_length:,} is past the "
                             f"{MAX_CONTEXT_LENGTH:,} positions pagedkv builds RoPE tables for")
    return ModelConfig(
        architecture=SUPPORTED_GGUF_ARCHITECTURES[architecture],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(file.require(key("feed_forward_length"))),
        num_layers=_block_count(file, key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(file.require(key("attention.layer_norm_rms_epsilon"))),
        rope_theta=float(file.value(key("rope.freq_base"), 10000.0)),
        max_position_embeddings=context_length,
        # llama.cpp writes output.weight only when it is not the embedding matrix.
        tie_word_embeddings="output.weight" not in file.tensors,
        eos_token_ids=eos_token_ids,
        bos_token_id=None if bos is None else int(bos),
    )


def _block_count(file: GGUFFile, key: str) -> int:
    """The layer count, which the model is built with before any weight is read: at most
    the layers whose tensors (blk.N.*) the file holds, so a small file cannot claim
    millions of layers and have them allocated."""
    claimed = _positive(file, key, int(file.require(key)))
    present = len({name.split(".", 2)[1] for name in file.tensors if name.startswith("blk.")})
    if claimed > present:
        raise ModelLoadError(f"{file.path}: {key} is {claimed:,} but the file holds the tensors of {present:,} "
                             "layers (blk.N.*); the metadata does not match the weights")
    return claimed


def _positive(file: GGUFFile, key: str, value: int) -> int:
    # Divided by and allocated with: 0 or less is a broken file, said before either happens.
    if value <= 0:
        raise ModelLoadError(f"{file.path}: {key} is {value}; it must be a positive count")
    return value


def _one_count(file: GGUFFile, key: str, default: int | None = None) -> int:
    # Some architectures store a per-layer list; pagedkv needs one number for all layers.
    value = file.value(key, default)
    if value is None:
        raise ModelLoadError(f"{file.path} lacks the metadata key {key}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{file.path}: {key} differs between layers ({sorted(set(value))}); unsupported")
        value = value[0]
    return int(value)


def _check_rope_scaling(file: GGUFFile, key) -> None:
    scaling = file.value(key("rope.scaling.type"), "none")
    factor = float(file.value(key("rope.scaling.factor"), 1.0))
    if scaling not in ("none", "") and not (scaling == "linear" and factor == 1.0):
        raise ModelLoadError(
            f"{file.path}: RoPE scaling {scaling!r} (factor {factor:g}) is unsupported for GGUF files; "
            "supported: none"
        )
