"""Our paged forward pass against transformers' forward on the same weights (float32).

Every kind of checkpoint runs the three shapes the engine produces: one whole prefill,
a prefill then token-by-token decode, and a mixed step (decode sequences first, then a
prefill chunk whose prefix is already in the pool, shared from another sequence). The
pool starts as large random garbage and block tables are shuffled and non-contiguous, so
reading a slot that was never written, or the wrong block, shows up as wrong logits.
"""

from __future__ import annotations

import pytest
import torch

from harness.hf_checkpoints import CHECKPOINT_KINDS, write_checkpoint
from harness.paged_runner import BLOCK_SIZE, PagedRunner
from model_service.loading.loader import load_model

ATOL = 1e-4
RTOL = 1e-4
PROMPT = "Paged attention keeps the KV cache in blocks; 日本語 🙂 too."


@pytest.fixture(scope="module", params=CHECKPOINT_KINDS)
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ours = load_model(str(path), torch.float32, "cpu")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, reference


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def assert_logits_match(ours: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_single_prefill(models):
    loaded, reference = models
    prompt = loaded.tokenizer.encode(PROMPT)
    assert len(prompt) > 3 * BLOCK_SIZE
    runner = PagedRunner(loaded.model, loaded.config)
    (logits,) = runner.step([("a", prompt)], num_decode_seqs=0)
    assert_logits_match(logits, reference_logits(reference, prompt))


def test_prefix_prefill_then_decode(models):
    loaded, reference = models
    prompt = loaded.tokenizer.encode(PROMPT)
    prefix_len = 7  # not a multiple of BLOCK_SIZE: decode continues inside a partial block
    expected = reference_logits(reference, prompt)
    runner = PagedRunner(loaded.model, loaded.config, seed=1)
    (logits,) = runner.step([("a", prompt[:prefix_len])], num_decode_seqs=0)
    assert_logits_match(logits, expected[:prefix_len])
    for position in range(prefix_len, len(prompt)):
        (logits,) = runner.step([("a", [prompt[position]])], num_decode_seqs=1)
        assert_logits_match(logits, expected[position : position + 1])


def test_greedy_generation_matches(models):
    loaded, reference = models
    prompt = loaded.tokenizer.encode("The quick brown fox")
    runner = PagedRunner(loaded.model, loaded.config, seed=2)
    (logits,) = runner.step([("a", prompt)], num_decode_seqs=0)
    ours = [int(logits[-1].argmax())]
    for _ in range(7):
        (logits,) = runner.step([("a", [ours[-1]])], num_decode_seqs=1)
        ours.append(int(logits[-1].argmax()))
    theirs, tokens = [], list(prompt)
    for _ in range(8):
        theirs.append(int(reference_logits(reference, tokens)[-1].argmax()))
        tokens.append(theirs[-1])
    assert ours == theirs


def test_mixed_batch_decode_and_cached_prefix_prefill(models):
    loaded, reference = models
    encode = loaded.tokenizer.encode
    seq_a = encode("A block table maps logical token positions.")[:10]
    seq_b = encode("Continuous batching mixes prefill and decode.")[:15]
    shared = 2 * BLOCK_SIZE
    seq_c = seq_a[:shared] + encode("Grüße aus München", add_special_tokens=False)[:9]
    runner = PagedRunner(loaded.model, loaded.config, seed=3)

    # Two prefills in one step, then a step with two decodes and a prefill whose first
    # two blocks are A's (a prefix-cache hit: C's first 8 tokens are never computed).
    logits_a, logits_b = runner.step([("a", seq_a), ("b", seq_b)], num_decode_seqs=0)
    assert_logits_match(logits_a, reference_logits(reference, seq_a))
    assert_logits_match(logits_b, reference_logits(reference, seq_b))
    next_a, next_b = int(logits_a[-1].argmax()), int(logits_b[-1].argmax())
    runner.share_prefix("a", "c", shared)
    step_a, step_b, step_c = runner.step(
        [("a", [next_a]), ("b", [next_b]), ("c", seq_c[shared:])], num_decode_seqs=2
    )
    assert_logits_match(step_a, reference_logits(reference, seq_a + [next_a])[-1:])
    assert_logits_match(step_b, reference_logits(reference, seq_b + [next_b])[-1:])
    assert_logits_match(step_c, reference_logits(reference, seq_c)[shared:])
    # A's own continuation did not disturb the blocks C shares: decode A once more.
    (step_a2,) = runner.step([("a", [int(step_a[-1].argmax())])], num_decode_seqs=1)
    assert_logits_match(step_a2, reference_logits(reference, seq_a + [next_a, int(step_a[-1].argmax())])[-1:])
