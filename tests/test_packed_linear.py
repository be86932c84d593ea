"""bfloat16 CPU linears with oneDNN-packed weights: the same numbers as F.linear, and
load_model packs exactly the bfloat16 CPU models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_checkpoints import write_checkpoint
from torch import nn

from model_service.loading.loader import load_model
from model_service.models.packed_linear import PackedLinear, pack_linears, packing_supported

needs_packing = pytest.mark.skipif(not packing_supported("cpu", torch.bfloat16),
                                   reason="this CPU's oneDNN has no bfloat16 support")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_at_every_batch_size(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    with torch.inference_mode():
        for rows in (1, 3, 64, 300):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        # A transposed (non-contiguous) input, and a 3-D one, still come out right.
        x = torch.randn(96, 5).to(torch.bfloat16).t()
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
        x3 = torch.randn(2, 4, 96).to(torch.bfloat16)
        assert torch.equal(packed(x3), F.linear(x3, linear.weight, linear.bias))


@needs_packing
def test_load_model_packs_bfloat16_cpu_models_only(tmp_path):
    path = write_checkpoint("qwen2", tmp_path / "qwen2")  # tied embeddings and q/k/v biases
    packed = load_model(str(path), torch.bfloat16, "cpu").model
    linears = [m for m in packed.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert packed.lm_head.weight is packed.embed_tokens.weight  # still tied
    plain = load_model(str(path), torch.float32, "cpu").model
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    assert pack_linears(plain) == 0
