"""The warmup measures the largest step the engine makes, sampling included.

The cache service sizes the pool from the device memory left after the warmup; whatever
the engine needs later and the warmup never allocated (the logits of max_num_seqs rows,
the sampler's float32 copies and its full-vocabulary sort, the CUDA modules those load)
must then fit in the headroom, or take memory from the pool or from another model service.
"""

from __future__ import annotations

import pytest
import torch

from model_service.loading.loader import load_model
from model_service.worker import runner as runner_module
from model_service.worker.runner import ModelRunner, measure_workspace, warmup_sampling

GiB = 2**30


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _kv_shape(config):
    return config.num_layers, config.num_kv_heads, config.head_dim


class FakeMemory:
    """A PeakMemory whose peak is what the spied work says it allocated after start()."""

    def __init__(self) -> None:
        self.started = False
        self.peak = 0

    def start(self) -> None:
        self.started = True

    def allocate(self, num_bytes: int) -> None:
        if self.started:
            self.peak = max(self.peak, num_bytes)

    def growth(self) -> int:
        return self.peak


@pytest.mark.parametrize("num_tokens, max_num_seqs, rows", [(64, 8, 8), (5, 8, 5), (64, 1, 1)])
def test_the_warmup_samples_the_logits_of_max_num_seqs_rows(monkeypatch, tiny, num_tokens, max_num_seqs, rows):
    steps, sampled = [], []
    real_execute, real_sample = ModelRunner.execute, runner_module.sample

    def execute(self, batch, prompt_logits=None):
        steps.append([new_tokens for _, new_tokens in batch])
        return real_execute(self, batch, prompt_logits)

    def sample(logits, options, generators, *rest):
        sampled.append((tuple(logits.shape), options))
        return real_sample(logits, options, generators, *rest)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    monkeypatch.setattr(runner_module, "sample", sample)
    measure_workspace(tiny.model, _kv_shape(tiny.config), torch.float32, torch.device("cpu"), block_size=16,
                      num_tokens=num_tokens, max_num_seqs=max_num_seqs)
    # One step of the scheduler's whole token budget: decode rows first, one prefill chunk.
    assert len(steps) == 1 and sum(steps[0]) == num_tokens and len(steps[0]) == rows
    assert steps[0][:-1] == [1] * (rows - 1)
    # Every row sampled at a temperature (the sampler's float32 copies, not one argmax).
    assert len(sampled) == 1 and sampled[0][0] == (rows, tiny.config.vocab_size)
    assert all(o == warmup_sampling(torch.device("cpu")) and not o.greedy for o in sampled[0][1])


def test_on_cuda_the_warmup_samples_with_a_nucleus():
    # On CUDA a nucleus sorts every row in full: the sampler's largest copies.
    options = warmup_sampling(torch.device("cuda", 1))
    assert not options.greedy and options.top_p < 1


def test_the_measured_workspace_includes_the_sampler(monkeypatch, tiny):
    memory = FakeMemory()
    real_sample = runner_module.sample

    def sample(logits, options, generators, *rest):
        memory.allocate(3 * GiB)  # what sampling max_num_seqs rows of a large vocabulary would take
        return real_sample(logits, options, generators, *rest)

    monkeypatch.setattr(runner_module, "sample", sample)
    workspace = measure_workspace(tiny.model, _kv_shape(tiny.config), torch.float32, torch.device("cpu"),
                                  block_size=16, num_tokens=32, max_num_seqs=4, memory=memory)
    assert workspace == 3 * GiB


def test_the_warmup_still_reads_kv_scales_from_its_prefill(tiny):
    absmax = []
    measure_workspace(tiny.model, _kv_shape(tiny.config), torch.float32, torch.device("cpu"), block_size=16,
                      num_tokens=48, max_num_seqs=4, kv_absmax=absmax)
    (k_max, v_max), = absmax
    assert len(k_max) == tiny.config.num_layers and min(k_max) > 0 and min(v_max) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_the_workspace_holds_the_samplers_copies():  # pragma: no cover - GPU only
    from model_service.models.config import ModelConfig
    from model_service.models.llama import LlamaForCausalLM

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=256, intermediate_size=512,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=2048)
    model = LlamaForCausalLM(config, attention_backend="triton")
    model.rotary.reset_cache(dtype=torch.bfloat16)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    rows = 64
    workspace = measure_workspace(model, _kv_shape(config), torch.bfloat16, torch.device("cuda"), block_size=16,
                                  num_tokens=128, max_num_seqs=rows)
    # The scaled float32 logits, their probabilities and the full sort's values: three
    # [rows, vocab] float32 tensors alive at once, at least.
    assert workspace >= 3 * rows * config.vocab_size * 4
