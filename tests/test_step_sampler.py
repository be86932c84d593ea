"""StepSampler with logits in the model's dtype (the runner hands bfloat16 models'
logits over as they are): a greedy batch takes its argmax from them directly, and
whatever computes with them (logit_bias, logprobs) does so in float32."""

from __future__ import annotations

import torch

from model_service.engine.output import new_request
from model_service.sample.params import SamplingOptions
from model_service.engine.step_sampler import StepSampler

VOCAB = 500


def due_rows(options: list[SamplingOptions]):
    completions = {}
    for key, option in enumerate(options):
        request = new_request(key, f"r{key}", [1, 2, 3], option, sink=lambda delta: None, tokenizer=None,
                              device=torch.device("cpu"), deadline=None, priority=0, arrival=key)
        completion = request.completions[0]
        completions[completion.seq] = completion
    return list(completions), completions


def bf16_logits(rows: int) -> torch.Tensor:
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 3).to(torch.bfloat16)


def test_greedy_rows_take_the_argmax_of_bfloat16_logits():
    logits = bf16_logits(6)
    logits[2, [7, 300]] = 40.0  # a tie: the first index, as torch.argmax
    due, completions = due_rows([SamplingOptions(max_new_tokens=4, detokenize=False)] * 6)
    _, tokens, logprobs = StepSampler(VOCAB, [], torch.device("cpu")).sample(due, logits, completions)
    assert tokens == logits.float().argmax(dim=-1).tolist() and tokens[2] == 7
    assert logprobs == [None] * 6


def test_adjustments_to_bfloat16_logits_are_made_in_float32():
    # Tokens 7 and 9 tie at 10.0; a logit_bias of 0.01 on 9 decides it in float32, while in
    # bfloat16 (spacing 0.0625 near 10) 10.0 + 0.01 rounds back to 10.0 and 7 would win.
    logits = torch.zeros(2, VOCAB, dtype=torch.bfloat16)
    logits[:, [7, 9]] = 10.0
    options = [SamplingOptions(max_new_tokens=4, detokenize=False, logit_bias=((9, 0.01),)),
               SamplingOptions(max_new_tokens=4, detokenize=False)]
    due, completions = due_rows(options)
    _, tokens, _ = StepSampler(VOCAB, [], torch.device("cpu")).sample(due, logits, completions)
    assert tokens == [9, 7]


def test_logprobs_of_bfloat16_logits_are_float32_log_softmax():
    logits = bf16_logits(3)
    due, completions = due_rows([SamplingOptions(max_new_tokens=4, detokenize=False, logprobs=2)] * 3)
    _, tokens, logprobs = StepSampler(VOCAB, [], torch.device("cpu")).sample(due, logits, completions)
    expected = torch.log_softmax(logits.float(), dim=-1)
    for row, (token, logprob) in enumerate(zip(tokens, logprobs)):
        assert logprob.token_id == token
        assert abs(logprob.logprob - expected[row, token].item()) < 1e-5  # bfloat16's would be ~1e-2 off


def test_a_step_with_logprobs_waits_for_the_device_once(monkeypatch):
    # The tokens and the logprobs asked for (some rows, with top alternatives) come back in
    # one to_host; nothing else is read back, nothing copied with torch.tensor(device=).
    from host_waits import HostWaits

    from model_service.engine import step_sampler
    from model_service.sample import logits_processing, logprobs, sampler

    monkeypatch.setattr(sampler, "_nucleus_in_full", lambda device: True)
    monkeypatch.setattr(sampler, "argmax_rows", lambda logits: logits.argmax(dim=-1))  # CUDA's
    logits = bf16_logits(4)
    options = [SamplingOptions(max_new_tokens=4, detokenize=False, logprobs=3),
               SamplingOptions(max_new_tokens=4, detokenize=False, temperature=0.7, top_p=0.9, top_k=50, seed=1),
               SamplingOptions(max_new_tokens=4, detokenize=False, temperature=1.0, min_p=0.05, logprobs=0, seed=2),
               SamplingOptions(max_new_tokens=4, detokenize=False, presence_penalty=0.5, logprobs=1)]
    due, completions = due_rows(options)
    expected = StepSampler(VOCAB, [], torch.device("cpu")).sample(due, logits, completions)
    due, completions = due_rows(options)  # fresh generators: the same draws
    with HostWaits(monkeypatch, step_sampler, sampler, logits_processing, logprobs) as waits:
        got = StepSampler(VOCAB, [], torch.device("cpu")).sample(due, logits, completions)
    assert waits.found == [] and waits.read_backs == 1
    assert got[1] == expected[1] and got[2] == expected[2]
    assert [len(entry.top) if entry else None for entry in got[2]] == [3, None, 0, 1]
