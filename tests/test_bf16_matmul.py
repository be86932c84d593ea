"""The bfloat16 product of csrc/bf16_matmul.c (cpu_kernels/bf16_matmul.py) and the
PanelLinear over it, at every level this CPU runs (each forced by PAGEDKV_BF16_KERNELS;
the levels it lacks skipped, saying so): close to a float64 product of the same
bfloat16 operands, a token's bits the same whatever batch and tile it is in (what lets the
decode stack and the per-layer path share the kernel), panels that give the weight back,
and the shapes it refuses refused with a reason."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import force, level_params
from torch import nn

from model_service.cpu_kernels import bf16_matmul, load
from model_service.models.packed_linear import pack_linears
from model_service.models.panel_linear import PanelLinear

library = load()
pytestmark = pytest.mark.skipif(library is None, reason="the CPU kernel library did not build")
BEST = bf16_matmul.cpu_level() if library is not None else 0
LEVELS = level_params(bf16_matmul.FAMILY)


@pytest.fixture
def level(request, monkeypatch) -> int:
    """The level of the test's parameter, forced by the switch users have."""
    return force(monkeypatch, bf16_matmul.FAMILY, request.param)

# rows: a multiple of the 4-panel group, a tail of one panel after groups of two or four,
# a last panel part empty; cols: SmolLM2's, a pair short of a line's worth, the least
SHAPES = [(128, 64), (80, 576), (100, 34), (7, 2)]


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(torch.bfloat16)


def assert_close_to_reference(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within what float32 sums and one bfloat16 rounding allow: a unit in the last place of
    bfloat16 (2^-8 relative) of the output, plus the sums' error over the products' size."""
    exact = x.double() @ weight.double().T
    scale = (x.double().abs() @ weight.double().abs().T)
    error = (out.double() - exact).abs()
    assert bool((error <= exact.abs() * 2 ** -8 + scale * 2 ** -16 + 1e-30).all()), float(error.max())


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_products_are_close_and_a_tokens_bits_do_not_depend_on_its_batch(level, rows, cols):
    torch.manual_seed(rows * cols)
    weight = torch.randn(rows, cols).to(torch.bfloat16)
    panels = bf16_matmul.pack_panels(weight)
    x = torch.randn(19, cols).to(torch.bfloat16)  # 19: two full tiles of 8 and a tail of 3
    batch = bf16_matmul.linear(x, panels, rows, level)
    assert batch.shape == (19, rows) and batch.dtype == torch.bfloat16
    assert_close_to_reference(batch, x, weight)
    for token in (0, 7, 8, 18):  # one token alone takes groups of four panels, not two
        alone = bf16_matmul.linear(x[token:token + 1], panels, rows, level)
        assert torch.equal(alone[0], batch[token]), f"token {token}'s row differs alone"
    for size in (2, 3, 9):
        assert torch.equal(bf16_matmul.linear(x[:size], panels, rows, level), batch[:size])


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_a_prefill_sized_batch_crosses_token_blocks_alike(level):
    """Past 128 tokens (panel_driver.h's PANEL_TOKEN_BLOCK) rows go a block at a time: the same bits."""
    torch.manual_seed(1)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    panels = bf16_matmul.pack_panels(weight)
    x = torch.randn(300, 64).to(torch.bfloat16)
    out = bf16_matmul.linear(x, panels, 48, level)
    assert_close_to_reference(out, x, weight)
    assert torch.equal(out[250:], bf16_matmul.linear(x[250:], panels, 48, level))


def test_the_levels_agree_closely():
    if BEST == 0:
        pytest.skip("one level on this CPU")
    torch.manual_seed(2)
    weight, x = torch.randn(64, 576).to(torch.bfloat16), torch.randn(5, 576).to(torch.bfloat16)
    panels = bf16_matmul.pack_panels(weight)
    portable, *simd = (bf16_matmul.linear(x, panels, 64, level) for level in range(BEST + 1))
    for other in simd:
        torch.testing.assert_close(portable.float(), other.float(), rtol=2 ** -7, atol=1e-2)


def test_special_values_round_as_torch_does_at_every_level():
    """Sums that overflow bfloat16 come out infinite, NaN weights give NaN rows, and a sum
    halfway between two bfloat16 values rounds to the even one, at the SIMD levels'
    conversions as at the portable one's."""
    weight = torch.zeros(16, 4, dtype=torch.bfloat16)
    weight[0, 0] = weight[0, 1] = 3e38  # 6e38: past bfloat16's largest, 3.4e38
    weight[1, 0] = float("nan")
    weight[2, 0], weight[2, 1] = 1, 2 ** -8  # halfway between 1 and 1 + 2^-7: to 1, the even one
    weight[3, 0], weight[3, 1] = 1, 3 * 2 ** -8  # halfway between 1 + 2^-7 and 1 + 2^-6: up, to the even one
    panels = bf16_matmul.pack_panels(weight)
    x = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.bfloat16)
    for level in range(BEST + 1):
        out = bf16_matmul.linear(x, panels, 16, level)[0].float()
        assert out[0] == float("inf") and out[1].isnan(), bf16_matmul.LEVELS[level]
        exact = (x.float() @ weight.float().T)[0, 2:4]  # float32 sums, exact here
        assert torch.equal(out[2:4], exact.to(torch.bfloat16).float()), bf16_matmul.LEVELS[level]


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_panels_give_the_weight_back(rows, cols):
    weight = torch.randn(rows, cols).to(torch.bfloat16)
    panels = bf16_matmul.pack_panels(weight)
    assert panels.shape == ((rows + 15) // 16, cols // 2, 16, 2)
    assert torch.equal(bf16_matmul.unpack_panels(panels, rows), weight)
    padding = panels.permute(0, 2, 1, 3).reshape(-1, cols)[rows:]  # the last panel's missing rows
    assert padding.shape[0] == -rows % 16 and not padding.any()


def test_shapes_it_does_not_take_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"even cols"):
        bf16_matmul.pack_panels(torch.zeros(16, 33, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bfloat16 \[rows, even cols\]"):
        bf16_matmul.pack_panels(torch.zeros(16, 32))
    panels = bf16_matmul.pack_panels(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="panels of 32 bfloat16 columns take x of that width"):
        bf16_matmul.linear(torch.zeros(2, 30, dtype=torch.bfloat16), panels, 16, 0)
    with pytest.raises(ValueError, match="panels of 32 bfloat16 columns"):
        bf16_matmul.linear(torch.zeros(2, 32), panels, 16, 0)


def test_an_x86_cpu_with_avx2_runs_the_avx2_level_at_least():
    """No AVX2 CPU falls to the portable C: its flags say AVX2 and FMA, the kernel's best
    level is AVX2 or above."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no x86 flags in /proc/cpuinfo")
    if not {"avx2", "fma"} <= set(flags):
        pytest.skip("this CPU lacks AVX2 and FMA")
    assert BEST >= bf16_matmul.LEVELS.index("avx2")


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_is_the_kernels_product_in_every_shape_of_input(level, bias):
    torch.manual_seed(3)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    module = PanelLinear.from_linear(linear, level)
    assert module.weight is None and module.bias is linear.bias  # the panels only
    assert torch.equal(module.dense_weight(), linear.weight)
    with torch.inference_mode():
        x = torch.randn(3, 96).to(torch.bfloat16)
        expected = bf16_matmul.linear(x, module.panels, 200, level)
        if bias:
            expected += linear.bias
        assert torch.equal(module(x), expected)
        assert torch.equal(module(x.t().contiguous().t()), expected)  # a transposed input
        assert torch.equal(module(x.view(1, 3, 96))[0], expected)  # a 3-D one
        with pytest.raises(TypeError, match="holds torch.bfloat16 weights; got torch.float32 input"):
            module(torch.randn(3, 96))


def test_pack_linears_keeps_a_shared_weight_and_skips_odd_widths(monkeypatch):
    """A tied lm_head keeps the embedding's weight beside its panels; a linear of odd width
    (no pairs of columns) goes to oneDNN, or stays plain."""
    monkeypatch.setenv(bf16_matmul.ENV, "portable")
    model = nn.Module()
    model.embed = nn.Embedding(50, 32).to(torch.bfloat16)
    model.head = nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    model.head.weight = model.embed.weight
    model.odd = nn.Linear(33, 8).to(torch.bfloat16)
    pack_linears(model)
    assert isinstance(model.head, PanelLinear) and model.head.weight is model.embed.weight
    assert not isinstance(model.odd, PanelLinear)
