"""bfloat16 CPU linears with packed weights, oneDNN's (PackedLinear) or the C kernel's
panels (PanelLinear, as PAGEDKV_BF16_KERNELS picks): oneDNN's give F.linear's numbers,
load_model packs exactly the bfloat16 CPU models, and the packed copy is the only one held
(a tied lm_head's weight stays, being the embedding's): weights_bytes counts what the
model's tensors hold, bfloat16 about half of float32's, and a load grows the process by
that much."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernel_levels import level_params
from safetensors.torch import save_file
from torch import nn

from harness.hf_checkpoints import write_checkpoint
from model_service.loading.loader import load_model
from model_service.cpu_kernels import bf16_matmul, f32_matmul
from model_service.models.packed_linear import PackedLinear, pack_linears, packed_nbytes, packing_supported
from model_service.models.panel_linear import PanelLinear
from model_service.models.weights_held import weights_bytes

PACKING = packing_supported("cpu", torch.bfloat16)
needs_packing = pytest.mark.skipif(not PACKING, reason="this CPU's oneDNN has no bfloat16 support")
# Who packs: oneDNN, or the C kernel at each of its levels (those this CPU lacks skipped).
PACKINGS = [pytest.param("onednn", marks=needs_packing), *level_params(bf16_matmul.FAMILY)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: write_checkpoint(kind, root / kind) for kind in ("llama", "qwen2")}  # qwen2: tied, biases


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_at_every_batch_size(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear)
    assert packed.weight is None and packed.bias is linear.bias  # the packed copy only
    assert torch.equal(packed.dense_weight(), linear.weight)
    assert packed_nbytes(packed.packed_weight) >= 200 * 96 * 2  # oneDNN pads 200 rows
    with torch.inference_mode():
        for rows in (1, 3, 64, 300):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        # A transposed (non-contiguous) input, and a 3-D one, still come out right.
        x = torch.randn(96, 5).to(torch.bfloat16).t()
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        x3 = torch.randn(2, 4, 96).to(torch.bfloat16)
        assert torch.equal(packed(x3), F.linear(x3, linear.weight, linear.bias))
        with pytest.raises(TypeError, match="holds torch.bfloat16 weights; got torch.float32 input"):
            packed(torch.randn(3, 96))


@pytest.mark.parametrize("packing", PACKINGS)
def test_load_model_packs_bfloat16_cpu_models_only(checkpoints, monkeypatch, packing):
    monkeypatch.setenv(bf16_matmul.ENV, packing)
    packed = load_model(str(checkpoints["qwen2"]), torch.bfloat16, "cpu").model
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, PackedLinear if packing == "onednn" else PanelLinear) for m in linears)
    # The embedding looks rows up in the tied lm_head's weight: it stays; no other does.
    assert packed.lm_head.weight is packed.embed_tokens.weight
    assert all(m.weight is None for m in linears if m is not packed.lm_head)
    monkeypatch.setenv(f32_matmul.ENV, "torch")  # float32's own panels: tests/test_f32_matmul.py
    plain = load_model(str(checkpoints["qwen2"]), torch.float32, "cpu").model
    assert not any(isinstance(m, (PackedLinear, PanelLinear)) for m in plain.modules())
    assert pack_linears(plain) == 0


def held_tensor_bytes(model: nn.Module) -> int:
    """The bytes of every distinct tensor the model's modules hold (parameters, buffers and
    plain attributes, in dicts, lists and tuples), each storage whole, buffers excepted."""
    storages: dict[object, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_mkldnn:  # opaque: no storage to key by
                storages[("mkldnn", id(value))] = torch.ops.mkldnn._nbytes(value)
            else:
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for module in model.modules():
        visit(vars(module))
    for buffer in model.buffers():  # RoPE tables, computed at load: not weights
        storages.pop(buffer.untyped_storage().data_ptr())
    return sum(storages.values())


@pytest.mark.parametrize("packing", ["onednn", "portable"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_weights_bytes_count_the_tensors_held_and_bfloat16_halves_them(checkpoints, monkeypatch, kind, packing):
    """Runs where oneDNN's packing does not happen too: then the plain bfloat16 weights are held."""
    monkeypatch.setenv(bf16_matmul.ENV, packing)
    monkeypatch.setenv(f32_matmul.ENV, "torch")  # float32 held plain, the size halved against
    path = str(checkpoints[kind])
    float32, bfloat16 = (load_model(path, dtype, "cpu") for dtype in (torch.float32, torch.bfloat16))
    for loaded in (float32, bfloat16):
        assert sum(loaded.weights_bytes_by_type.values()) == weights_bytes(loaded.model) \
            == held_tensor_bytes(loaded.model)
    config = json.loads((checkpoints[kind] / "config.json").read_text())
    # More than half: a packed lm_head tied to the embedding is one bfloat16 copy of it
    # more, and oneDNN pads some packed weights (qwen2's 96-row qkv_proj to 128 rows),
    # panels a last panel's rows to 16.
    packs = packing == "portable" or PACKING
    tied_copy = 2 * config["vocab_size"] * config["hidden_size"] if packs and config["tie_word_embeddings"] else 0
    packed = [m for m in bfloat16.model.modules() if isinstance(m, (PackedLinear, PanelLinear))]
    padding = sum((packed_nbytes(m.packed_weight) if isinstance(m, PackedLinear) else m.panels.nbytes)
                  - 2 * m.in_features * m.out_features for m in packed)
    half = float32.weights_bytes_by_type["float32"] // 2
    assert bfloat16.weights_bytes_by_type == {"bfloat16": half + tied_copy + padding}
    assert 0 <= padding <= 0.05 * half and bool(packed) == packs


def write_wide_checkpoint(small, directory, hidden=1024, intermediate=2048, layers=4):
    """`small`'s config and tokenizer at these sizes, weights all 0.01 in bfloat16: 74 MB
    held in bfloat16, written fast (no transformers model is built)."""
    shutil.copytree(small, directory, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((directory / "config.json").read_text())
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    kv = hidden // heads * kv_heads
    config.update(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  head_dim=hidden // heads, tie_word_embeddings=False)
    (directory / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        shapes |= {f"{prefix}self_attn.q_proj.weight": (hidden, hidden), f"{prefix}self_attn.k_proj.weight": (kv, hidden),
                   f"{prefix}self_attn.v_proj.weight": (kv, hidden), f"{prefix}self_attn.o_proj.weight": (hidden, hidden),
                   f"{prefix}mlp.gate_proj.weight": (intermediate, hidden),
                   f"{prefix}mlp.up_proj.weight": (intermediate, hidden),
                   f"{prefix}mlp.down_proj.weight": (hidden, intermediate),
                   f"{prefix}input_layernorm.weight": (hidden,), f"{prefix}post_attention_layernorm.weight": (hidden,)}
    save_file({name: torch.full(shape, 0.01, dtype=torch.bfloat16) for name, shape in shapes.items()},
              str(directory / "model.safetensors"))
    return sum(torch.Size(shape).numel() for shape in shapes.values())


RSS_SCRIPT = """
import sys, torch
from model_service.loading.loader import load_model
def rss():  # anonymous memory: the shared libraries and the mapped checkpoint are not weights
    return int(next(line for line in open('/proc/self/status') if line.startswith('RssAnon')).split()[1]) * 1024
load_model(sys.argv[1], torch.bfloat16, 'cpu')  # pays the first load's imports and libraries' set-up
before = rss()
loaded = load_model(sys.argv[2], torch.bfloat16, 'cpu')
print(rss() - before, sum(loaded.weights_bytes_by_type.values()))
"""


def test_a_bfloat16_load_grows_the_process_by_its_weights_bytes(checkpoints, tmp_path):
    """In a fresh process, on a checkpoint large enough to see: anonymous memory grown by
    loading it in bfloat16 is its weights_bytes, half of float32's 4 bytes a weight, within
    6 MB. A plain copy kept beside the packed one, or one the allocator kept resident, would
    be 74 MB more (as was a float32 copy made while materializing: loader.py)."""
    parameters = write_wide_checkpoint(checkpoints["llama"], tmp_path / "wide")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    output = subprocess.run([sys.executable, "-c", RSS_SCRIPT, checkpoints["llama"], tmp_path / "wide"],
                            capture_output=True, text=True, env=env, check=True).stdout.split()
    grown, held = int(output[-2]), int(output[-1])
    assert held == 2 * parameters  # every 2-D weight packed without padding at these sizes, or plain
    assert abs(grown - held) <= 6 * 2**20, (grown, held)
