"""The fused layer ops' C kernels (cpu_kernels/layer_ops.py) against the torch code they
replace (models/fused_ops.py): the same values, to float32 summation order in float32 and
to one rounding step in the 16-bit types, and the C path is the one taken on CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import needs_c_kernels

from model_service import cpu_kernels
from model_service.cpu_kernels import layer_ops
from model_service.models import fused_ops
from model_service.models.rope import apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Outputs are compared in float32: float32 to summation order; 16-bit to about one step
# of their rounding at the values' scale (a few units: normalized activations are O(1)).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
pytestmark = needs_c_kernels


@pytest.fixture(scope="module")
def library():
    return cpu_kernels.load()


def close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "cols"), [(1, 576), (37, 256), (5, 100), (130, 17)])
def test_rms_norm(library, dtype, rows, cols):
    generator = torch.Generator().manual_seed(cols)
    # Rows further apart than cols: the layer's input may be a view.
    x = (torch.randn(rows, cols + 7, generator=generator) * 3).to(dtype)[:, :cols]
    weight = torch.randn(cols, generator=generator).to(dtype)

    close(layer_ops.rms_norm(library, x, weight, 1e-5), fused_ops.rms_norm_torch(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "cols"), [(1, 576), (48, 256), (3, 33)])
def test_add_rms_norm_adds_in_place_and_norms(library, dtype, rows, cols):
    generator = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, cols, generator=generator).to(dtype)
    delta = torch.randn(rows, cols + 5, generator=generator).to(dtype)[:, :cols]
    weight = torch.randn(cols, generator=generator).to(dtype)
    expected_hidden = hidden + delta
    expected_normed = fused_ops.rms_norm_torch(expected_hidden, weight, 1e-6)

    normed = layer_ops.add_rms_norm(library, hidden, delta, weight, 1e-6)

    assert torch.equal(hidden, expected_hidden)  # the add rounds exactly as torch's
    close(normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (20, 688), (7, 45)])
def test_silu_mul(library, dtype, rows, inter):
    generator = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=generator) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)

    close(layer_ops.silu_mul(library, gate_up), torch.nn.functional.silu(gate) * up, dtype)


def test_silu_mul_at_extremes(library):
    # exp's clamping: silu(-100) is -0 (not NaN), silu(100) is 100.
    gate_up = torch.tensor([[-100.0, 100.0, 0.0, -1e-8, 2.0, 3.0, 4.0, 5.0]])
    torch.testing.assert_close(layer_ops.silu_mul(library, gate_up),
                               torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (3, 32), (5, 6)])
def test_rotary_in_place(library, dtype, heads, head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 300, (9,), generator=generator)
    angles = torch.outer(torch.arange(300.0), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # q and k heads of a fused projection: rows hold further (v) heads after them.
    fused = torch.randn(9, heads + 2, head_dim, generator=generator).to(dtype)
    x = fused[:, :heads]
    v_before = fused[:, heads:].clone()
    expected = apply_rotary(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))

    layer_ops.rotary_in_place(library, x, cos, sin, positions)

    close(x, expected, dtype)
    assert torch.equal(fused[:, heads:], v_before)  # nothing past the rotated heads is touched


def test_fused_ops_take_the_c_path_on_cpu(monkeypatch):
    calls = []
    for name in ("rms_norm", "add_rms_norm", "silu_mul", "rotary_in_place"):
        original = getattr(layer_ops, name)
        monkeypatch.setattr(layer_ops, name, lambda *a, _original=original, _name=name: (calls.append(_name), _original(*a))[1])
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    weight = torch.ones(8, dtype=torch.bfloat16)
    fused_ops.rms_norm(x, weight, 1e-5)
    fused_ops.add_rms_norm(x.clone(), x, weight, 1e-5)
    fused_ops.silu_mul(x)
    table = torch.zeros(10, 2, dtype=torch.bfloat16)
    fused_ops.RotaryStep(table, table, torch.arange(4)).rotate(x.view(4, 2, 4))
    assert calls == ["rms_norm", "add_rms_norm", "silu_mul", "rotary_in_place"]
    # A non-contiguous gate/up or a 3-D input takes the torch code instead, with the same result.
    wide = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(fused_ops.silu_mul(wide[:, :8]), torch.nn.functional.silu(wide[:, :4]) * wide[:, 4:8])
    assert calls == ["rms_norm", "add_rms_norm", "silu_mul", "rotary_in_place"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_model_step_agrees_with_and_without_the_kernels(monkeypatch, dtype):
    # The tiny model through prefill then decode, once on the C kernels, once on the torch
    # code alone (torch attention backend, layer ops' C path off), same weights and pool.
    from model_service.loading.tiny import build_tiny_model
    from harness.paged_runner import PagedRunner

    with_c = build_tiny_model(dtype)
    on_torch = build_tiny_model(dtype, attention_backend="torch")
    prompt = torch.randint(3, with_c.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(model):
        runner = PagedRunner(model, model.config)
        (prefill,) = runner.step([("a", prompt)], num_decode_seqs=0)
        (decode,) = runner.step([("a", [int(prefill[-1].argmax())])], num_decode_seqs=1)
        return prefill, decode

    ours = run(with_c)
    monkeypatch.setattr(fused_ops, "_library", lambda *tensors: None)
    reference = run(on_torch)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.float(), theirs.float(), atol=tolerance, rtol=tolerance)
