"""The float32 product of csrc/f32_matmul.c (cpu_kernels/f32_matmul.py) and the PanelLinear
over it, at every level this CPU runs (each forced by PAGEDKV_F32_KERNELS; the levels it
lacks skipped, saying so): close to a float64 product of the same operands, a token's bits
the same whatever batch and tile it is in (what lets the decode stack and the per-layer
path share the kernel), every level the same bits (one fused multiply-add a product, the
columns in order), panels that give the weight back, and the inputs it refuses refused
with a reason."""

from __future__ import annotations

import pytest
import torch
from kernel_levels import level_fixture
import torch.nn.functional as F
from torch import nn

from model_service.cpu_kernels import f32_matmul, levels, load
from model_service.models.packed_linear import pack_linears
from model_service.models.panel_linear import PanelLinear

library = load()
pytestmark = pytest.mark.skipif(library is None, reason="the CPU kernel library did not build")
BEST = levels.best(f32_matmul.FAMILY.name) if library is not None else 0
level = level_fixture(f32_matmul)

# rows: a multiple of the 4-panel group, a tail of one panel after groups of two or four,
# a last panel part empty, fewer than a panel; cols: SmolLM2's, odd, one
SHAPES = [(128, 64), (80, 576), (100, 33), (7, 1)]


def assert_close_to_float64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within what float32 sums of `cols` products in order allow."""
    exact = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    error = (out.double() - exact).abs()
    assert bool((error <= scale * x.shape[1] * 2 ** -23 + 1e-30).all()), float(error.max())


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_products_are_close_and_a_tokens_bits_do_not_depend_on_its_batch(level, rows, cols):
    torch.manual_seed(rows * cols)
    weight = torch.randn(rows, cols)
    panels = f32_matmul.pack_panels(weight)
    x = torch.randn(19, cols)  # 19: tiles of 3 (AVX2), 4 (portable), 6 (AVX-512) and tails
    batch = f32_matmul.linear(x, panels, rows, level)
    assert batch.shape == (19, rows) and batch.dtype == torch.float32
    assert_close_to_float64(batch, x, weight)
    for token in (0, 7, 8, 18):  # one token alone takes groups of four panels, not two
        alone = f32_matmul.linear(x[token:token + 1], panels, rows, level)
        assert torch.equal(alone[0], batch[token]), f"token {token}'s row differs alone"
    for size in (2, 3, 9):
        assert torch.equal(f32_matmul.linear(x[:size], panels, rows, level), batch[:size])
    # the portable level's bits, whatever level ran
    assert torch.equal(batch, f32_matmul.linear(x, panels, rows, 0))


def test_a_prefill_sized_batch_crosses_token_blocks_alike(level):
    """Past 128 tokens (panel_driver.h's PANEL_TOKEN_BLOCK) rows go a block at a time: the same bits."""
    torch.manual_seed(1)
    weight = torch.randn(48, 64)
    panels = f32_matmul.pack_panels(weight)
    x = torch.randn(300, 64)
    out = f32_matmul.linear(x, panels, 48, level)
    assert_close_to_float64(out, x, weight)
    assert torch.equal(out[250:], f32_matmul.linear(x[250:], panels, 48, level))


def test_special_values_come_out_as_float32_sums_do(level):
    weight = torch.zeros(16, 4)
    weight[0, 0] = weight[0, 1] = 3e38  # 6e38: past float32's largest
    weight[1, 0] = float("nan")
    weight[2, 0] = float("inf")
    out = f32_matmul.linear(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), f32_matmul.pack_panels(weight), 16, level)[0]
    assert out[0] == float("inf") and out[1].isnan() and out[2] == float("inf") and not out[3:].any()


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_panels_give_the_weight_back(rows, cols):
    weight = torch.randn(rows, cols)
    panels = f32_matmul.pack_panels(weight)
    assert panels.shape == ((rows + 15) // 16, cols, 16)
    assert torch.equal(f32_matmul.unpack_panels(panels, rows), weight)
    padding = panels.permute(0, 2, 1).reshape(-1, cols)[rows:]  # the last panel's missing rows
    assert padding.shape[0] == -rows % 16 and not padding.any()


def test_inputs_it_does_not_take_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"float32 panels take float32 \[rows, cols\]"):
        f32_matmul.pack_panels(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"float32 panels take float32"):
        f32_matmul.pack_panels(torch.zeros(0, 32))
    panels = f32_matmul.pack_panels(torch.zeros(16, 32))
    with pytest.raises(ValueError, match="panels of 32 float32 columns take x of that width"):
        f32_matmul.linear(torch.zeros(2, 30), panels, 16, 0)
    with pytest.raises(ValueError, match="panels of 32 float32 columns"):
        f32_matmul.linear(torch.zeros(2, 32, dtype=torch.bfloat16), panels, 16, 0)
    for above in (BEST + 1, len(f32_matmul.LEVELS)):  # a level this CPU lacks, a level no CPU has
        with pytest.raises(RuntimeError, match=r"f32_linear failed \(-1\)"):
            f32_matmul.linear(torch.zeros(2, 32), panels, 16, above)


def test_an_x86_cpu_with_avx2_runs_the_avx2_level_at_least():
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        pytest.skip("no x86 flags in /proc/cpuinfo")
    if not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU lacks AVX2 and FMA")
    assert BEST >= f32_matmul.LEVELS.index("avx512" if "avx512f" in flags else "avx2")


@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_is_the_kernels_product_in_every_shape_of_input(level, bias):
    torch.manual_seed(3)
    linear = nn.Linear(96, 200, bias=bias)
    module = PanelLinear.from_linear(linear, level)
    assert module.weight is None and module.bias is linear.bias  # the panels only
    assert torch.equal(module.dense_weight(), linear.weight)
    with torch.inference_mode():
        x = torch.randn(3, 96)
        expected = f32_matmul.linear(x, module.panels, 200, level)
        if bias:
            expected += linear.bias
        assert torch.equal(module(x), expected)
        torch.testing.assert_close(module(x), linear(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(module(x.t().contiguous().t()), expected)  # a transposed input
        assert torch.equal(module(x.view(1, 3, 96))[0], expected)  # a 3-D one
        with pytest.raises(TypeError, match="holds torch.float32 weights; got torch.bfloat16 input"):
            module(x.bfloat16())


def test_pack_linears_puts_every_float32_linear_in_panels(monkeypatch):
    """The decoder layers' linears and the lm_head go to panels, a tied lm_head keeping its
    plain weight for the embedding; PAGEDKV_F32_KERNELS=torch leaves every linear plain."""
    def model():
        built = nn.Module()
        built.embed = nn.Embedding(50, 32)
        built.layers = nn.ModuleList([nn.Linear(32, 40), nn.Linear(40, 32, bias=False)])
        built.lm_head = nn.Linear(32, 50, bias=False)
        built.lm_head.weight = built.embed.weight
        return built

    monkeypatch.setenv(f32_matmul.ENV, "portable")
    packed = model()
    x = torch.randn(3, 32)
    expected = F.linear(x, packed.lm_head.weight)
    assert pack_linears(packed) == 3
    assert all(isinstance(linear, PanelLinear) and linear.weight is None for linear in packed.layers)
    assert type(packed.lm_head) is PanelLinear and packed.lm_head.weight is packed.embed.weight
    torch.testing.assert_close(packed.lm_head(x), expected, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv(f32_matmul.ENV, "torch")
    plain = model()
    assert pack_linears(plain) == 0 and not any(isinstance(m, PanelLinear) for m in plain.modules())
