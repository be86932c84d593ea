"""A decode step's layers in one C call (models/cpu_decode_stack.py) against the same model's
per-layer path: the same kernels in the same order, so the logits and every K/V written
to the pool must be the same bits, not merely close.

Each comparison runs two PagedRunners from the same seed (the same random pool and
shuffled block tables) through one model, the stack on for one and off for the other:
a prefill of three prompts, then decode steps of all three at once, whose contexts cross
block boundaries (PagedRunner's blocks hold 4 tokens).
"""

from __future__ import annotations

import pytest
import torch
from gguf_checkpoints import write_gguf
from kernel_levels import force, level_params

from harness.hf_checkpoints import write_checkpoint
from harness.paged_runner import PagedRunner
from model_service.attention.metadata import AttentionMetadata
from model_service.cpu_kernels import bf16_matmul, f32_matmul, load, lora_sgmv, quant_matmul
from model_service.cpu_kernels.quant_matmul import KERNEL_TYPES
from model_service.loading.loader import load_model
from model_service.models.cpu_decode_stack import DecodeStack
from model_service.models.panel_linear import PanelLinear

PROMPTS = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 1]]
DECODE_STEPS = 6


def run(model, config, stack: bool, pool_dtype: torch.dtype | None = None,
        prompts: list[list[int]] = PROMPTS, adapters: dict | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each decode step's logits and the pool after them (pool_dtype: an 8-bit pool, the
    model's scales set by the caller; adapters: {prompt index: LoRA adapter})."""
    model.decode_stack_enabled = stack
    runner = PagedRunner(model, config)
    if pool_dtype is not None:
        runner.pool = runner.pool.float().clamp(-400, 400).to(pool_dtype)
    by_seq = {str(i): adapter for i, adapter in (adapters or {}).items()}
    logits = runner.step([(str(i), prompt) for i, prompt in enumerate(prompts)], 0, by_seq)
    tokens = [int(rows[-1].argmax()) for rows in logits]
    steps = []
    for _ in range(DECODE_STEPS):
        logits = runner.step([(str(i), [token]) for i, token in enumerate(tokens)], len(prompts), by_seq)
        steps.append(torch.cat(logits))
        tokens = [int(rows[-1].argmax()) for rows in logits]
    return steps, runner.pool


def assert_stack_is_the_layer_path(loaded, monkeypatch, pool_dtype=None, prompts=PROMPTS, adapters=None) -> None:
    model, config = loaded.model, loaded.config
    reference_steps, reference_pool = run(model, config, stack=False, pool_dtype=pool_dtype, prompts=prompts,
                                          adapters=adapters)
    first_layer_calls = []
    layer_forward = model.layers[0].forward
    monkeypatch.setattr(model.layers[0], "forward", lambda *args: first_layer_calls.append(1) or layer_forward(*args))
    steps, pool = run(model, config, stack=True, pool_dtype=pool_dtype, prompts=prompts, adapters=adapters)
    assert len(first_layer_calls) == 1, "a decode step took the per-layer path"  # the prefill alone
    assert isinstance(model._decode_stack, DecodeStack)
    for index, (ours, theirs) in enumerate(zip(steps, reference_steps, strict=True)):
        assert torch.equal(ours, theirs), f"decode step {index}: logits differ by {float((ours - theirs).abs().max())}"
    assert torch.equal(pool.view(torch.uint8), reference_pool.view(torch.uint8)), "the K/V written differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("type_name", list(KERNEL_TYPES.values()))
def test_stack_matches_the_layer_path(tmp_path, monkeypatch, type_name, dtype):
    sizes = {"hidden_size": 256, "intermediate_size": 512} if type_name.endswith("_K") else {}
    path, _ = write_gguf(tmp_path / f"tiny-{type_name}.gguf", type_name, **sizes)
    assert_stack_is_the_layer_path(load_model(str(path), dtype, "cpu", weights="native"), monkeypatch)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_stack_on_an_fp8_pool_matches_the_layer_path(tmp_path, monkeypatch, pool_dtype):
    """K/V quantized as they are written (csrc/kv_write.c on both paths), with scales other
    than one that differ by layer."""
    path, _ = write_gguf(tmp_path / "tiny-Q4_1.gguf", "Q4_1")
    loaded = load_model(str(path), torch.float32, "cpu", weights="native")
    loaded.model.set_kv_scales([(0.5 + layer, 0.25 * (layer + 1)) for layer in range(loaded.config.num_layers)])
    assert_stack_is_the_layer_path(loaded, monkeypatch, pool_dtype)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_large_decode_batch_takes_the_stack_when_every_linear_is_interleaved(tmp_path, monkeypatch, type_name):
    """17 sequences decoding, past quant_matmul.FLOAT_PRODUCT_TOKENS: interleaved rows
    multiply in integers at any batch, so the stack takes the step and gives the
    per-layer path's bits. (Short prompts: 17 sequences of 8 tokens fill 34 of
    PagedRunner's 48 blocks.)"""
    path, _ = write_gguf(tmp_path / f"tiny-{type_name}.gguf", type_name)
    prompts = [[(7 * i + j) % 50 + 1 for j in range(1 + i % 2)] for i in range(17)]
    assert quant_matmul.FLOAT_PRODUCT_TOKENS <= len(prompts)
    loaded = load_model(str(path), torch.float32, "cpu", weights="native")
    assert_stack_is_the_layer_path(loaded, monkeypatch, prompts=prompts)


@pytest.mark.skipif(load() is None, reason="the CPU kernel library did not build")
@pytest.mark.parametrize("level", level_params(bf16_matmul.FAMILY))
def test_a_bfloat16_model_in_panels_takes_the_stack_at_any_batch(tmp_path, monkeypatch, level):
    """A bfloat16 checkpoint's linears in bf16_matmul's panels: one kernel at every batch,
    so 17 sequences decoding take the stack too, and give the per-layer path's bits."""
    force(monkeypatch, bf16_matmul.FAMILY, level)
    loaded = load_model(str(write_checkpoint("llama", tmp_path / "llama")), torch.bfloat16, "cpu")
    layer = loaded.model.layers[0]
    assert all(isinstance(module, PanelLinear) and bf16_matmul.LEVELS[module.level] == level
               for module in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    prompts = [[(7 * i + j) % 50 + 1 for j in range(1 + i % 2)] for i in range(17)]
    assert_stack_is_the_layer_path(loaded, monkeypatch, prompts=prompts)


@pytest.mark.skipif(load() is None, reason="the CPU kernel library did not build")
@pytest.mark.parametrize("level", level_params(f32_matmul.FAMILY))
def test_a_float32_model_in_panels_takes_the_stack_at_any_batch(tmp_path, monkeypatch, level):
    """A float32 checkpoint's linears in f32_matmul's panels (its lm_head too, outside the
    stack): 17 sequences decoding take the stack, and give the per-layer path's bits."""
    force(monkeypatch, f32_matmul.FAMILY, level)
    loaded = load_model(str(write_checkpoint("llama", tmp_path / "llama")), torch.float32, "cpu")
    layer = loaded.model.layers[0]
    assert all(isinstance(module, PanelLinear) and module.panels.dtype == torch.float32
               and f32_matmul.LEVELS[module.level] == level
               for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj))
    assert isinstance(loaded.model.lm_head, PanelLinear) and f32_matmul.LEVELS[loaded.model.lm_head.level] == level
    prompts = [[(7 * i + j) % 50 + 1 for j in range(1 + i % 2)] for i in range(17)]
    assert_stack_is_the_layer_path(loaded, monkeypatch, prompts=prompts)


@pytest.mark.skipif(load() is None, reason="the CPU kernel library did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("level", level_params(lora_sgmv.FAMILY))
def test_a_step_with_adapters_takes_the_stack_and_gives_the_layer_paths_bits(tmp_path, monkeypatch, level, dtype):
    """Decode steps mixing two adapters (one on every target, one on q and v) and the base,
    in runs the base splits: the stack adds the deltas with lora_sgmv's kernel (its float32
    or its bfloat16 one, the adapters held in the model's dtype), as the per-layer path
    does, to the same bits; and they are deltas (the logits differ from the base's)."""
    pytest.importorskip("peft")
    from lora_adapters import ALL_TARGETS, hf_llama_of, write_adapter
    from model_service.lora.peft_adapter import load_adapter

    force(monkeypatch, lora_sgmv.FAMILY, level)
    loaded = load_model(str(write_checkpoint("llama", tmp_path / "llama")), dtype, "cpu")
    adapters = [load_adapter(f"a{index}", write_adapter(tmp_path / f"a{index}", hf_llama_of(loaded.config), rank=8,
                                                        alpha=16, targets=targets, seed=index, scale=0.3),
                             loaded.config, max_rank=64, dtype=dtype)
                for index, targets in enumerate([ALL_TARGETS, ["q_proj", "v_proj"]])]
    prompts = [[(5 * i + j) % 40 + 1 for j in range(2 + i % 3)] for i in range(6)]
    chosen = {0: adapters[0], 1: adapters[0], 3: adapters[1], 4: adapters[0], 5: adapters[0]}  # 2: the base
    assert_stack_is_the_layer_path(loaded, monkeypatch, prompts=prompts, adapters=chosen)
    monkeypatch.undo()
    base_steps, _ = run(loaded.model, loaded.config, stack=True, prompts=prompts)
    with_adapters, _ = run(loaded.model, loaded.config, stack=True, prompts=prompts, adapters=chosen)
    assert not torch.equal(base_steps[0], with_adapters[0])


def test_adapters_the_c_kernel_does_not_serve_run_the_layer_path(tmp_path, monkeypatch):
    """With PAGEDKV_LORA_KERNELS=torch (torch's matmuls add the deltas) a step with adapter
    rows never takes the stack, and a step of the base alone still does."""
    pytest.importorskip("peft")
    from lora_adapters import ALL_TARGETS, hf_llama_of, write_adapter
    from model_service.lora.peft_adapter import load_adapter

    monkeypatch.setenv(lora_sgmv.ENV, "torch")
    loaded = load_model(str(write_checkpoint("llama", tmp_path / "llama")), torch.float32, "cpu")
    adapter = load_adapter("a", write_adapter(tmp_path / "a", hf_llama_of(loaded.config), rank=8, alpha=16,
                                              targets=ALL_TARGETS, seed=0, scale=0.3), loaded.config, max_rank=64)
    stack = DecodeStack.of(loaded.model)
    assert stack is not None
    calls = []
    layer_forward = loaded.model.layers[0].forward
    monkeypatch.setattr(loaded.model.layers[0], "forward", lambda *args: calls.append(1) or layer_forward(*args))
    run(loaded.model, loaded.config, stack=True, adapters={0: adapter})
    assert len(calls) == 1 + DECODE_STEPS  # the prefill and every decode step, layer by layer
    calls.clear()
    run(loaded.model, loaded.config, stack=True)
    assert len(calls) == 1  # the prefill alone


def test_smollm2_in_bfloat16_stack_matches_the_layer_path(monkeypatch):
    """At the CPU's best level, what auto serves."""
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    if bf16_matmul.chosen_level() is None:
        pytest.skip("this CPU has no SIMD level of the bfloat16 kernel")
    assert_stack_is_the_layer_path(load_model("smollm2", torch.bfloat16, "cpu"), monkeypatch)


def test_smollm2_stack_matches_the_layer_path(monkeypatch):
    assert_stack_is_the_layer_path(load_model("smollm2", torch.float32, "cpu", weights="native"), monkeypatch)


def test_models_it_does_not_take_run_the_layer_path(tmp_path, monkeypatch):
    path, _ = write_gguf(tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    monkeypatch.setenv(f32_matmul.ENV, "torch")
    dequantized = load_model(str(path), torch.float32, "cpu", weights="dequantize")
    run(dequantized.model, dequantized.config, stack=True)
    assert dequantized.model._decode_stack is False  # torch's float32 linears: asked once, then left alone
    monkeypatch.setenv(bf16_matmul.ENV, "onednn")
    onednn = load_model(str(path), torch.bfloat16, "cpu", weights="dequantize")
    run(onednn.model, onednn.config, stack=True)
    assert onednn.model._decode_stack is False  # oneDNN's packed weights run outside C

    native = load_model(str(path), torch.float32, "cpu", weights="native")
    stack = DecodeStack.of(native.model)
    assert stack is not None
    config = native.config
    shape = (config.num_layers, 2, 4, 4, config.num_kv_heads, config.head_dim)
    hidden, positions = torch.zeros((1, config.hidden_size)), torch.tensor([2])
    decode = AttentionMetadata(slot_mapping=torch.tensor([2]), block_tables=torch.tensor([[1]], dtype=torch.int32),
                               context_lens=torch.tensor([3], dtype=torch.int32), query_lens=(1,),
                               context_lens_host=(3,), num_decode_seqs=1, block_size=4)
    assert stack.run(hidden, positions, torch.zeros(shape), decode) is not None
    fp8 = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    assert stack.run(hidden, positions, fp8, decode) is None  # an 8-bit pool without scales
    assert stack.run(hidden, positions, torch.zeros(shape, dtype=torch.bfloat16), decode) is None
    native.model.set_kv_scales([(1.0, 1.0)] * config.num_layers)
    scaled = DecodeStack.of(native.model)
    assert scaled.run(hidden, positions, fp8, decode) is not None
    assert scaled.run(hidden, positions, torch.zeros(shape), decode) is None  # scales, but a float32 pool
    bfloat16 = load_model(str(path), torch.bfloat16, "cpu", weights="native")
    bfloat16.model.set_kv_scales([(1.0, 1.0)] * config.num_layers)
    assert DecodeStack.of(bfloat16.model).run(hidden.bfloat16(), positions, fp8, decode) is None  # reads in float32
    prefill = AttentionMetadata(slot_mapping=torch.tensor([2]), block_tables=torch.tensor([[1]], dtype=torch.int32),
                                context_lens=torch.tensor([3], dtype=torch.int32), query_lens=(1,),
                                context_lens_host=(3,), num_decode_seqs=0, block_size=4)
    assert stack.run(hidden, positions, torch.zeros(shape), prefill) is None


def test_the_stack_follows_weights_that_moved(tmp_path, monkeypatch):
    """A `.to()` after the first decode step moves the norms: the stack is described again
    rather than reading freed memory."""
    path, _ = write_gguf(tmp_path / "tiny-Q4_0.gguf", "Q4_0")
    loaded = load_model(str(path), torch.float32, "cpu", weights="native")
    run(loaded.model, loaded.config, stack=True)
    first = loaded.model._decode_stack
    for module in (loaded.model.norm, *loaded.model.layers):
        for parameter in module.parameters(recurse=True):
            parameter.data = parameter.data.clone()
    assert not first.points_at(loaded.model)
    assert_stack_is_the_layer_path(loaded, monkeypatch)
    assert loaded.model._decode_stack is not first
