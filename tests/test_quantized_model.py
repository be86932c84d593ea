"""The whole model with GGUF weights held in their blocks (--weights native) against the
same file dequantized at load (--weights dequantize): a test-written file of each type
with a kernel, and SmolLM2's shipped Q4_1 file.

What differs is only the activations' 8-bit quantization (per block of 32, scale
amax / 127: at most 1/254 of a block's largest value per activation, see
test_quant_kernels.py), compounded through the layers. Stated tolerances:
- logits: max |native - dequantize| <= LOGIT_TOLERANCE x max |logit| (2 layers of the
  test files; SmolLM2's 30 layers get SMOLLM2_LOGIT_TOLERANCE, measured there at 4%);
- greedy tokens: equal, up to the first step where the dequantized model's top two
  logits are within that absolute tolerance of each other (a near tie, which 8-bit
  activations may flip); the test asserts that any divergence starts at such a tie.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf_checkpoints import write_gguf
from quantized_compare import assert_equal_up_to_a_near_tie, greedy

from harness.paged_runner import PagedRunner
from model_service.cpu_kernels import f32_matmul
from model_service.cpu_kernels.quant_matmul import KERNEL_TYPES
from model_service.loading.embedded import embedded_model_path
from model_service.loading.loader import load_model
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from model_service.models.weights_held import weights_bytes

TYPES = list(KERNEL_TYPES.values())
LOGIT_TOLERANCE = 0.03
SMOLLM2_LOGIT_TOLERANCE = 0.08
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Grüße 🙂 from a tiny model", "1 2 3 4 5 6"]
NEW_TOKENS = 8


def compare(path: str, tolerance: float, prompts: list[str], native=None) -> None:
    native = native or load_model(path, torch.float32, "cpu", weights="native")
    reference = load_model(path, torch.float32, "cpu", weights="dequantize")
    assert any(isinstance(module, QuantizedLinear) for module in native.model.modules())
    assert not any(isinstance(module, QuantizedLinear) for module in reference.model.modules())
    for prompt in prompts:
        ours_prefill, ours_tokens, _ = greedy(native.model, native.config, native.tokenizer, prompt, NEW_TOKENS)
        ref_prefill, ref_tokens, ref_logits = greedy(reference.model, reference.config, reference.tokenizer, prompt,
                                                     NEW_TOKENS)
        absolute = tolerance * float(ref_prefill.abs().max())
        difference = float((ours_prefill - ref_prefill).abs().max())
        assert difference <= absolute, f"{prompt!r}: logits differ by {difference:.4f} > {absolute:.4f}"
        assert_equal_up_to_a_near_tie(ours_tokens, ref_tokens, ref_logits, absolute)


@pytest.mark.parametrize("type_name", TYPES)
def test_native_weights_match_the_dequantized_model(tmp_path, type_name):
    sizes = {"hidden_size": 256, "intermediate_size": 512} if type_name.endswith("_K") else {}
    path, _ = write_gguf(tmp_path / f"tiny-{type_name}.gguf", type_name, **sizes)
    compare(str(path), LOGIT_TOLERANCE, PROMPTS)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", torch.float32, "cpu", weights="native")


def test_smollm2_q4_1_native_matches_dequantized(smollm2):
    compare("smollm2", SMOLLM2_LOGIT_TOLERANCE, PROMPTS[:1], native=smollm2)


def test_smollm2_holds_the_files_blocks(smollm2):
    model = smollm2.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)  # Q8_0, and the tied lm_head shares it
    assert model.lm_head.segments.parts[0][1].data_ptr() == model.embed_tokens.blocks.data_ptr()
    assert model.layers[0].self_attn.qkv_proj.types == ["Q4_1"]
    # docs/sizing.md's worked example: the Q4_1 linears, the Q8_0 embedding once, float32 norms;
    # less than the file, which holds the tokenizer too.
    assert smollm2.weights_bytes_by_type == {"Q4_1": 66_355_200, "Q8_0": 30_081_024, "float32": 140_544}
    assert weights_bytes(model) == 96_576_768 < embedded_model_path().stat().st_size


def test_make_runs_answer_up_to_its_near_tie(smollm2):
    """`make run`'s question with native weights, teacher-forced with the answer the
    dequantized model gives (tests/test_smollm2_generate.py): "The capital of France is
    Paris." then end of sequence. Its first token is a near tie in the reference itself
    (dequantized logits: "The" 25.33, "L" 25.24), which 8-bit activations flip ("L" 24.79,
    "The" 24.40); every later token is native's own greedy choice."""
    prompt = smollm2.chat_template.render([{"role": "user", "content": "What is the capital of France?"}])
    answer = smollm2.tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    answer.append(next(iter(smollm2.config.eos_token_ids)))
    runner = PagedRunner(smollm2.model, smollm2.config)
    (logits,) = runner.step([("a", smollm2.tokenizer.encode(prompt, add_special_tokens=False))], num_decode_seqs=0)
    steps = [logits[-1]]
    for token in answer[:-1]:
        (logits,) = runner.step([("a", [token])], num_decode_seqs=1)
        steps.append(logits[-1])
    first = steps[0]
    assert float(first.max() - first[answer[0]]) <= SMOLLM2_LOGIT_TOLERANCE * float(first.abs().max())
    assert [int(step.argmax()) for step in steps[1:]] == answer[1:]


@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied"])
def test_weights_bytes_as_held_in_both_modes(tmp_path, monkeypatch, tied):
    """What GetModelInfo and the sizing report (LoadedModel.weights_bytes_by_type) against
    the file itself: native holds each Q4_0 tensor's bytes as written (a tied lm_head adds
    none) and the F32 norms as float32; dequantize holds every tensor as float32."""
    from gguf import GGUFReader

    path, _ = write_gguf(tmp_path / "tiny-Q4_0.gguf", "Q4_0", tie_word_embeddings=tied)
    tensors = GGUFReader(path).tensors
    q4_0 = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "Q4_0")
    f32 = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == "F32")
    elements = sum(int(t.n_elements) for t in tensors)
    monkeypatch.setenv(f32_matmul.ENV, "torch")  # float32 linears plain parameters, as counted below
    native = load_model(str(path), torch.float32, "cpu", weights="native")
    dequantized = load_model(str(path), torch.float32, "cpu", weights="dequantize")
    assert native.weights_bytes_by_type == {"Q4_0": q4_0, "float32": f32}
    assert dequantized.weights_bytes_by_type == {"float32": 4 * elements}
    # The same total from the model's own tensors: parameters, then each module's blocks once.
    blocks = {blocks.data_ptr(): blocks.numel() for module in native.model.modules()
              if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) for _, blocks in module.segments.parts}
    assert weights_bytes(native.model) == sum(p.numel() * 4 for p in native.model.parameters()) + sum(blocks.values())
    assert weights_bytes(dequantized.model) == sum(p.numel() * 4 for p in dequantized.model.parameters())
    assert weights_bytes(native.model) < weights_bytes(dequantized.model) / 5
    assert (native.weights_tag, dequantized.weights_tag) == ("weights=native", "")


RSS_SCRIPT = """
import sys, torch
from model_service.cpu_kernels import load
from model_service.loading.embedded import embedded_model_path
from model_service.loading.freed_memory import return_freed_memory
from model_service.loading.gguf_config import config_from_gguf
from model_service.loading.gguf_file import GGUFFile
from model_service.loading.loader import gguf_text, load_model
load()
def rss():  # anonymous memory: the shared libraries that loading pages in are not weights
    return int(next(line for line in open('/proc/self/status') if line.startswith('RssAnon')).split()[1]) * 1024
before = rss()
file = GGUFFile(embedded_model_path())
text = gguf_text(file, config_from_gguf(file))
del file
return_freed_memory()
tokenizer = rss() - before
before = rss()
loaded = load_model('smollm2', torch.float32, 'cpu', weights=sys.argv[1])
print(tokenizer, rss() - before, sum(loaded.weights_bytes_by_type.values()))
"""


def test_rss_after_loading_smollm2_against_the_file_size():
    """Anonymous resident memory grown by loading with native weights, in a fresh process,
    against the file's 98.4 MB: at most 1.25x (the target), tokenizer included, and
    at most 1.1x without it (the growth of building the tokenizer, measured first in the
    same process). What grows is the 96.6 MB of blocks, the tokenizer (the Rust BPE's
    vocabulary and merges) and the RoPE tables. The margins are for the allocators'
    variation; a float32 copy of the weights (538 MB, what --weights dequantize holds),
    gguf's own parse of the metadata kept alive (gguf_file.py) or torch's Python meta
    kernels (meta_build.py), each tens of MB, would be past them."""
    file_size = embedded_model_path().stat().st_size
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tokenizer, grown, held = (int(n) for n in subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, "native"], capture_output=True, text=True, env=env, check=True,
    ).stdout.split()[-3:])
    assert held <= grown <= 1.25 * file_size, (tokenizer, grown, held)
    assert grown - tokenizer <= 1.1 * file_size, (tokenizer, grown, held)
