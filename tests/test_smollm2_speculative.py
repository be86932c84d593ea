"""SmolLM2 with ngram speculation, against the shared stack's plain decoding: the same
greedy text token for token (prompt that repeats its input, stop strings, n > 1, a
logprobs request, which decodes one token a step, prefix-cache hits from the shared pool),
and a seeded sampled request's too."""

from __future__ import annotations

import grpc
import pytest
from grpc_generate import GREEDY, generate

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.processes import start_model_service
from pagedkv.model.v1 import model_pb2_grpc

DOCUMENT = ("Invoice 4471 was issued by Northwind Traders to Contoso Ltd on 12 March 2024 for 18 crates of "
            "olive oil at 42.50 euros each, due within 30 days. The contact is Maria Anders, "
            "maria.anders@northwind.example, and the reference code is NW-4471-CT.")
PROMPTS = [
    f"{DOCUMENT}\nExtract the invoice number, buyer, seller, quantity and contact email as JSON:\n",
    f"{DOCUMENT}\nQuote the sentence that says who the contact is, word for word:\n",
    f"{DOCUMENT}\nRewrite the text above with 18 changed to 20:\n",
]


def tokens_of(generated, index: int) -> list[int]:
    return [token for response in generated.responses if response.index == index for token in response.token_ids]


@pytest.fixture(scope="module")
def speculative(smollm2_stack, tmp_path_factory):
    # Beside the shared stack's model service, on its cache service: the same checkpoint,
    # so prefixes either computed are exact hits for the other.
    with start_model_service(tmp_path_factory.mktemp("smollm2-spec"), smollm2_stack.cache.address,
                             "--model", "smollm2", "--max-model-len", "512", "--max-batch-prefill-tokens", "512",
                             "--speculative-method", "ngram", "--num-speculative-tokens", "4", "--speculative-always",
                             timeout_s=600) as model, grpc.insecure_channel(model.address) as channel:
        yield model_pb2_grpc.ModelServiceStub(channel)


# (sampling fields, prompts, tokens): the plain case over every prompt, the others over
# one, short, to keep the module's time small on two cores.
CASES = {
    "plain": ({}, PROMPTS[::2], 24),
    "stop-strings": ({"stop": ["}", "Maria"]}, PROMPTS[:1], 32),
    "n2": ({"n": 2}, PROMPTS[1:2], 12),
    "logprobs": ({"logprobs": 2}, PROMPTS[1:2], 12),
    # Sampled and seeded: each token drawn with the uniform a one-token step would have used.
    "seeded": ({"temperature": 0.7, "top_p": 0.9, "seed": 7}, PROMPTS[:1], 16),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_text_is_the_plain_text(smollm2_stack, speculative, case):
    extra, prompts, max_new_tokens = CASES[case]
    for prompt in prompts:
        sampling = dict(GREEDY, max_new_tokens=max_new_tokens, **extra)
        plain = generate(smollm2_stack.stub, prompt=prompt, sampling=sampling)
        spec = generate(speculative, prompt=prompt, sampling=sampling)
        for index in range(extra.get("n", 1)):
            assert tokens_of(spec, index) == tokens_of(plain, index), (prompt, extra, index)
        if "n" not in extra:
            assert spec.text == plain.text
            assert spec.usage.completion_tokens == plain.usage.completion_tokens
        if not extra or "seed" in extra:
            assert spec.usage.spec_proposed_tokens > 0
    wait_for(lambda: stats(cache_stub(smollm2_stack.cache.address)).blocks_leased == 0, 30, "every block released")
