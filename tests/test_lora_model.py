"""LoRA deltas in the paged forward (models/lora_delta.py) against transformers + peft with
the adapter merged into a float32 copy of the base: greedy tokens equal and logits close, for
one adapter alone and for a batch that mixes three adapters (different targets) and the base,
at ranks 8 and 64, through prefill and decode steps."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.hf_checkpoints import write_checkpoint
from model_service.loading.loader import load_model
from model_service.lora.peft_adapter import load_adapter
from model_service.models.lora_delta import LoraStep
from lora_adapters import ALL_TARGETS, run_paged, write_adapter

pytest.importorskip("peft")
# Merged (W + s·B·A) and factored (x·W + s·(x·A)·B) float32 products round differently; the
# gap grows with the rank (and the delta's size), so these are looser than the base's 1e-4.
ATOL = 1e-3
RTOL = 1e-4
PROMPTS = ["The quick brown fox", "Paged attention keeps blocks", "日本語 🙂 too", "LoRA adapters share a base"]
TARGET_SETS = [ALL_TARGETS, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "o_proj", "k_proj"]]
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    ours = load_model(str(path), torch.float32, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, reference


@pytest.fixture(scope="module", params=[8, 64])
def adapters(request, base, tmp_path_factory):
    """Three adapters of rank `param` (ours, and the reference with it merged)."""
    from peft import PeftModel

    ours, reference = base
    made = []
    for index, targets in enumerate(TARGET_SETS):
        directory = write_adapter(tmp_path_factory.mktemp(f"r{request.param}-{index}") / "a",
                                  copy.deepcopy(reference), rank=request.param, alpha=2 * request.param,
                                  targets=targets, seed=index, use_rslora=index == 2, scale=0.3)
        merged = PeftModel.from_pretrained(copy.deepcopy(reference), str(directory)).merge_and_unload().eval()
        made.append((load_adapter(f"a{index}", directory, ours.config, max_rank=64), merged))
    return made


def greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens])).logits[0].float()
    return tokens[len(prompt):], logits


def test_one_adapter_alone(base, adapters):
    loaded, _ = base
    adapter, merged = adapters[0]
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    expected_tokens, expected_logits = greedy_reference(merged, prompt, DECODE_STEPS)
    ((tokens, logits),) = run_paged(loaded, {"a": (prompt, adapter)}, DECODE_STEPS).values()
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits[: len(prompt) + DECODE_STEPS - 1], atol=ATOL, rtol=RTOL)


def test_a_batch_mixing_three_adapters_and_the_base(base, adapters):
    loaded, reference = base
    models = [merged for _, merged in adapters] + [reference]
    chosen = [adapter for adapter, _ in adapters] + [None]
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    # The base's sequence sits between two adapters' so runs split around it.
    order = [0, 3, 1, 2]
    sequences = {f"s{i}": (prompts[i], chosen[i]) for i in order}
    got = run_paged(loaded, sequences, DECODE_STEPS)
    base_tokens = greedy_reference(reference, prompts[0], DECODE_STEPS)[0]
    for i in order:
        expected_tokens, expected_logits = greedy_reference(models[i], prompts[i], DECODE_STEPS)
        tokens, logits = got[f"s{i}"]
        assert tokens == expected_tokens, f"sequence {i}"
        torch.testing.assert_close(logits, expected_logits[: len(prompts[i]) + DECODE_STEPS - 1], atol=ATOL, rtol=RTOL)
    # The adapters change what is generated: the comparison above is not of the base with itself.
    assert got["s0"][0] != base_tokens


def test_runs_group_neighbouring_sequences_of_one_adapter():
    a, b = object(), object()
    step = LoraStep.of_sequences([1, 1, 1, 4, 2, 3], [a, a, None, b, b, a])
    assert [(r.start, r.end, r.adapter) for r in step.runs] == [(0, 2, a), (3, 9, b), (9, 12, a)]
    assert LoraStep.of_sequences([3, 1], [None, None]) is None
