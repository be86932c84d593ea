"""--quantization int8: a Hugging Face checkpoint's linears and embedding held as Q8_0
blocks (one float16 scale per 32 weights of a row) and multiplied by the integer kernels,
against the same checkpoint in float32.

Two roundings differ from float32: each weight to the nearest of its block's 255 steps
(at most half a step, amax / 254), and each activation the same way (the kernels'
8-bit activations, test_quant_kernels.py): each product is off by at most about 2/254
(0.8 %) of its blocks' largest terms, compounded through 2 layers and the lm_head.
Stated tolerances:
- logits: max |int8 - float32| <= INT8_LOGIT_TOLERANCE × max |logit| (measured at most
  3.0 % over the six kinds of harness/hf_checkpoints.py and four prompts);
- greedy tokens: equal, up to the first step where float32's top two logits are within
  that absolute tolerance (a near tie): any divergence must start at one.
"""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from quantized_compare import assert_equal_up_to_a_near_tie, greedy
from safetensors import safe_open

from harness.hf_checkpoints import write_checkpoint
from harness.processes import start_cache_service, start_model_service
from model_service.loading.hf_int8 import CHUNK_ROWS, quantize_q8_0
from model_service.loading.loader import load_model
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

INT8_LOGIT_TOLERANCE = 0.05
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Grüße 🙂 from a tiny model", "1 2 3 4 5 6"]
NEW_TOKENS = 8


def test_blocks_are_ggufs_q8_0_to_the_bit():
    """The kernels are tested on gguf's blocks (test_quant_kernels.py): these are the same
    bytes, bfloat16 input, an all-zero block (scale 0) and more rows than one chunk included."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(CHUNK_ROWS + 3, 96, generator=generator) * 0.05
    weight[5, 32:64] = 0
    weight[7, :32] = torch.arange(32) - 15.5  # halves: rounded away from zero
    for tensor in (weight, weight.bfloat16()):
        expected = quantize(tensor.float().numpy(), GGMLQuantizationType.Q8_0)
        assert np.array_equal(quantize_q8_0(tensor).numpy(), expected)
    with pytest.raises(ValueError, match="multiple of 32 columns, got 48"):
        quantize_q8_0(torch.zeros(2, 48))


def held_bytes_from_checkpoint(directory) -> dict[str, int]:
    """What int8 should hold, from the safetensors alone: every 2-D tensor (the tied
    lm_head never, being the embedding) at 34 bytes per 32 weights, the rest in float32."""
    held = {"Q8_0": 0, "float32": 0}
    for shape in checkpoint_shapes(directory):
        numel = int(np.prod(shape))
        if len(shape) == 2:
            held["Q8_0"] += numel // 32 * 34
        else:
            held["float32"] += numel * 4
    return held


def checkpoint_shapes(directory) -> list[list[int]]:
    """The shapes of the checkpoint's tensors, a tied lm_head's left out (the embedding's)."""
    tied = json.loads((directory / "config.json").read_text()).get("tie_word_embeddings")
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        return [handle.get_slice(name).get_shape() for name in handle.keys()
                if not (tied and name == "lm_head.weight")]


# GQA with llama3 RoPE; biases on q/k/v and o_proj; tied embeddings with q/k/v biases.
@pytest.mark.parametrize("kind", ["llama", "llama-mha-bias", "qwen2"])
def test_int8_matches_float32_up_to_a_near_tie(tmp_path, kind):
    directory = write_checkpoint(kind, tmp_path / kind)
    reference = load_model(str(directory), torch.float32, "cpu")
    int8 = load_model(str(directory), torch.float32, "cpu", quantization="int8")
    modules = list(int8.model.modules())
    assert not any(type(module) in (torch.nn.Linear, torch.nn.Embedding) for module in modules)
    assert sum(isinstance(module, QuantizedLinear) for module in modules) == 4 * int8.config.num_layers + 1
    assert isinstance(int8.model.embed_tokens, QuantizedEmbedding)
    if int8.config.tie_word_embeddings:
        assert int8.model.lm_head.segments.parts[0][1].data_ptr() == int8.model.embed_tokens.blocks.data_ptr()

    assert int8.weights_bytes_by_type == held_bytes_from_checkpoint(directory)
    # Against the checkpoint's float32 bytes, not the float32 model's: that one holds a tied
    # lm_head's packed copy besides (packed_linear.py).
    float32_bytes = sum(int(np.prod(shape)) * 4 for shape in checkpoint_shapes(directory))
    ratio = sum(int8.weights_bytes_by_type.values()) / float32_bytes
    assert 0.25 < ratio < 0.28, ratio  # 34 / 128 for the blocks, norms (and biases) in float32
    assert (int8.weights_tag, reference.weights_tag) == ("weights=int8", "")

    for prompt in PROMPTS:
        ours_prefill, ours_tokens, _ = greedy(int8.model, int8.config, int8.tokenizer, prompt, NEW_TOKENS)
        ref_prefill, ref_tokens, ref_logits = greedy(reference.model, reference.config, reference.tokenizer,
                                                     prompt, NEW_TOKENS)
        absolute = INT8_LOGIT_TOLERANCE * float(ref_prefill.abs().max())
        difference = float((ours_prefill - ref_prefill).abs().max())
        assert difference <= absolute, f"{prompt!r}: logits differ by {difference:.4f} > {absolute:.4f}"
        assert_equal_up_to_a_near_tie(ours_tokens, ref_tokens, ref_logits, absolute)


def test_int8_is_refused_where_it_makes_no_sense(tmp_path):
    from gguf_checkpoints import write_gguf

    gguf_path, _ = write_gguf(tmp_path / "tiny.gguf", "Q8_0")
    refusals = [
        (("smollm2", "cpu"), "'smollm2' is a GGUF file, quantized already: --weights native keeps its own blocks"),
        ((str(gguf_path), "cpu"), "is a GGUF file, quantized already"),
        (("tiny", "cpu"), "'tiny' is built in process"),
        ((str(tmp_path), "cuda"), "runs on CPU only (its kernels are CPU code); on cuda, serve the checkpoint in "
                                  "--dtype bfloat16 instead"),
    ]
    for (spec, device), message in refusals:
        with pytest.raises(ValueError, match=re.escape(message)) as refused:
            load_model(spec, torch.float32, device, quantization="int8")
        assert str(refused.value).startswith("--quantization int8 ")
    with pytest.raises(ValueError, match="--quantization 'int4': expected one of none, int8"):
        load_model("tiny", torch.float32, "cpu", quantization="int4")


def test_a_service_serves_int8_and_reports_its_bytes(tmp_path):
    """Over gRPC: GetModelInfo and the cache service's sizing carry the weights' bytes as
    held, by type, as loaded in process; the fingerprint says int8 (its K/V are its own);
    greedy tokens follow float32's up to a near tie."""
    directory = write_checkpoint("llama", tmp_path / "llama")
    int8 = load_model(str(directory), torch.float32, "cpu", quantization="int8")
    reference = load_model(str(directory), torch.float32, "cpu")
    held = int8.weights_bytes_by_type
    with start_cache_service(tmp_path, "--kv-cache-bytes", "4MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(directory), "--quantization", "int8",
                                "--http-port", "-1") as model, \
            grpc.insecure_channel(model.address) as model_channel, \
            grpc.insecure_channel(cache.address) as cache_channel:
        info = model_pb2_grpc.ModelServiceStub(model_channel).GetModelInfo(model_pb2.GetModelInfoRequest(),
                                                                           timeout=30)
        assert info.weights_bytes == sum(held.values()) and dict(info.weights_bytes_by_type) == held
        assert info.model_fingerprint.endswith("/weights=int8")
        sizing = cache_pb2_grpc.CacheServiceStub(cache_channel).GetSizing(cache_pb2.GetSizingRequest(), timeout=30)
        assert sizing.weights_bytes == info.weights_bytes and dict(sizing.weights_bytes_by_type) == held
        assert any(line.startswith("weights_bytes = ") and "Q8_0" in line for line in sizing.explanation)

        prompt = reference.tokenizer.encode(PROMPTS[0])
        request = model_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=model_pb2.SamplingParams(
            max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        served = [token for response in model_pb2_grpc.ModelServiceStub(model_channel).Generate(request, timeout=60)
                  for token in response.token_ids]
    ref_prefill, ref_tokens, ref_logits = greedy(reference.model, reference.config, reference.tokenizer, PROMPTS[0],
                                                 NEW_TOKENS)
    assert len(served) == NEW_TOKENS
    assert_equal_up_to_a_near_tie(served, ref_tokens, ref_logits,
                                  INT8_LOGIT_TOLERANCE * float(ref_prefill.abs().max()))
