"""`--dtype auto` (loading/dtype_choice.py): a checkpoint stored in bfloat16 stays bfloat16
on a CPU where a bfloat16 product runs at speed (the C kernel at a SIMD level, or oneDNN's),
float32 elsewhere and for every other model, with the reason the service logs; and the
model service's start says which it chose."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.hf_checkpoints import write_checkpoint
from model_service.cpu_kernels import bf16_matmul, load
from model_service.errors import ModelLoadError
from model_service.loading.dtype_choice import auto_dtype, stored_dtype
from model_service.models.packed_linear import packing_supported

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same checkpoint stored in float32 (as written) and in bfloat16."""
    root = tmp_path_factory.mktemp("dtype")
    float32 = write_checkpoint("llama", root / "float32")
    bfloat16 = write_checkpoint("llama", root / "bfloat16")
    tensors = load_file(bfloat16 / "model.safetensors")
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in tensors.items()}, bfloat16 / "model.safetensors",
              metadata={"format": "pt"})
    return {"float32": float32, "bfloat16": bfloat16}


def test_the_stored_dtype_is_read_from_the_headers(checkpoints):
    assert stored_dtype(checkpoints["float32"]) == torch.float32
    assert stored_dtype(checkpoints["bfloat16"]) == torch.bfloat16


def test_a_bfloat16_checkpoint_stays_bfloat16_where_a_simd_kernel_takes_it(checkpoints, monkeypatch):
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    dtype, why = auto_dtype(str(checkpoints["bfloat16"]), CPU)
    level = bf16_matmul.chosen_level()
    if level is not None and level > 0:
        assert dtype == torch.bfloat16 and f"the C kernel at {bf16_matmul.LEVELS[level]}" in why, why
    elif packing_supported("cpu", torch.bfloat16):
        assert dtype == torch.bfloat16 and "oneDNN" in why, why
    else:
        assert dtype == torch.float32 and "no bfloat16 product" in why, why


@pytest.mark.skipif(load() is None, reason="the CPU kernel library did not build")
def test_the_portable_level_alone_does_not_make_auto_choose_bfloat16(checkpoints, monkeypatch):
    """Forced to the portable C (a CPU without a SIMD level), bfloat16 is not what this CPU
    computes fast: float32, unless oneDNN has bfloat16 here."""
    monkeypatch.setenv(bf16_matmul.ENV, "portable")
    dtype, why = auto_dtype(str(checkpoints["bfloat16"]), CPU)
    assert dtype == (torch.bfloat16 if packing_supported("cpu", torch.bfloat16) else torch.float32), why


def test_every_other_model_stays_float32(checkpoints, tmp_path):
    assert auto_dtype(str(checkpoints["float32"]), CPU) == (torch.float32, "the checkpoint stores float32")
    for spec in ("tiny", "smollm2"):
        assert auto_dtype(spec, CPU)[0] == torch.float32
    assert auto_dtype(str(checkpoints["bfloat16"]), CPU, quantization="int8")[0] == torch.float32
    assert auto_dtype(str(checkpoints["bfloat16"]), torch.device("cuda")) == (torch.bfloat16,
                                                                            "CUDA computes in bfloat16")


def test_a_directory_without_weights_fails_as_loading_it_would(tmp_path):
    with pytest.raises(ModelLoadError, match="no weights in"):
        auto_dtype(str(tmp_path), CPU)
