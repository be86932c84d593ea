"""Load Hugging Face safetensors into the fused layout of LlamaForCausalLM.

Every tensor name is checked before any is copied, so a wrong checkpoint fails at once
with the names that are missing or unexpected. Tensors are read one at a time and copied
straight into the model's (already allocated) parameters: the peak is one tensor, not a
second copy of the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.models.llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; we recompute them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, and the rows of it (fused layouts)."""

    param_name: str
    row_start: int
    row_end: int


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index_path = directory / INDEX_FILE
    single_path = directory / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise ModelLoadError(f"cannot read {index_path}: {error!r}") from None
        files = {name: directory / file_name for name, file_name in weight_map.items()}
        absent = sorted({str(path.name) for path in files.values() if not path.is_file()})
        if absent:
            raise ModelLoadError(f"{index_path.name} names shard files missing from {directory}: {absent}")
        return _verify_index(files)
    if single_path.is_file():
        with safe_open(single_path, framework="pt") as handle:
            return {name: single_path for name in handle.keys()}
    raise ModelLoadError(f"no weights in {directory}: expected {SINGLE_FILE} or {INDEX_FILE}")


def _verify_index(files: dict[str, Path]) -> dict[str, Path]:
    # An index may claim a tensor its shard lacks; catch it here rather than mid-copy.
    by_file: dict[Path, set[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, set()).add(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as handle:
            absent = names - set(handle.keys())
        if absent:
            raise ModelLoadError(f"{path.name} lacks tensors its index lists: {sorted(absent)[:10]}")
    return files


def expected_tensors(config: ModelConfig) -> dict[str, _Target]:
    """Hugging Face tensor name -> where it lands in LlamaForCausalLM."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    targets = {
        "model.embed_tokens.weight": _Target("embed_tokens.weight", 0, config.vocab_size),
        "model.norm.weight": _Target("norm.weight", 0, config.hidden_size),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = _Target("lm_head.weight", 0, config.vocab_size)
    for layer in range(config.num_layers):
        hf, ours = f"model.layers.{layer}", f"layers.{layer}"
        qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for proj, (start, end) in qkv_rows.items():
            targets[f"{hf}.self_attn.{proj}.weight"] = _Target(f"{ours}.self_attn.qkv_proj.weight", start, end)
            if config.attention_bias:
                targets[f"{hf}.self_attn.{proj}.bias"] = _Target(f"{ours}.self_attn.qkv_proj.bias", start, end)
        targets[f"{hf}.self_attn.o_proj.weight"] = _Target(f"{ours}.self_attn.o_proj.weight", 0, config.hidden_size)
        if config.o_proj_bias:
            targets[f"{hf}.self_attn.o_proj.bias"] = _Target(f"{ours}.self_attn.o_proj.bias", 0, config.hidden_size)
        targets[f"{hf}.mlp.gate_proj.weight"] = _Target(f"{ours}.mlp.gate_up_proj.weight", 0, inter)
        targets[f"{hf}.mlp.up_proj.weight"] = _Target(f"{ours}.mlp.gate_up_proj.weight", inter, 2 * inter)
        targets[f"{hf}.mlp.down_proj.weight"] = _Target(f"{ours}.mlp.down_proj.weight", 0, config.hidden_size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{hf}.{norm}.weight"] = _Target(f"{ours}.{norm}.weight", 0, config.hidden_size)
    return targets


def load_weights(model: LlamaForCausalLM, directory: str | Path, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """Copy a checkpoint's tensors into `model` (converted to each parameter's dtype and
    device), except those named in `skip` (already loaded another way: hf_int8.py)."""
    directory = Path(directory)
    config = model.config
    files = checkpoint_files(directory)
    targets = expected_tensors(config)

    def ignorable(name: str) -> bool:
        # A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
        return name.endswith(_IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")

    missing = sorted(set(targets) - set(files))
    unexpected = sorted(name for name in set(files) - set(targets) if not ignorable(name))
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint in {directory} does not match {config.architecture}: "
                             + describe_tensor_mismatch(missing, unexpected))

    params = dict(model.named_parameters(remove_duplicate=False))
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        if name not in skip:
            by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as handle:
                for name in names:
                    target = targets[name]
                    destination = params[target.param_name][target.row_start : target.row_end]
                    tensor = handle.get_tensor(name)
                    if tensor.shape != destination.shape:
                        raise ModelLoadError(
                            f"{name} in {path.name} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)


def describe_tensor_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """"missing tensors ...; unexpected tensors ...", for whichever of the two is not empty."""
    parts = []
    if missing:
        parts.append(f"missing tensors {_abbrev(missing)}")
    if unexpected:
        parts.append(f"unexpected tensors {_abbrev(unexpected)}")
    return "; ".join(parts)


def _abbrev(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"
