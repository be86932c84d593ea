"""What the generation options cost one decode step at batch 48 (vocab 32,000), CPU.

Times, in turns and as medians over many repetitions, the sampling of one W48-sized
decode step: the bare batched sampler (`sampling.sample`, what the engine called before
the generation API), the engine's StepSampler with every option off (the path W48 takes
now), and with logprobs=5, penalties, min_p, and logit_bias on every row. The first two
differ only by the per-step bookkeeping the new options added; that difference, against
a W48 decode step, is the cost of the options to a batch that uses none.

    .venv/bin/python bench/sampling_overhead.py [--threads 2] [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_service.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from model_service.engine.output import Completion, RequestOutput  # noqa: E402
from model_service.sample.params import SamplingOptions  # noqa: E402
from model_service.sample.sampler import sample  # noqa: E402
from model_service.sched.sequence import Sequence  # noqa: E402
from model_service.engine.step_sampler import StepSampler  # noqa: E402

BATCH, VOCAB = 48, 32000


class NoTokenizer:
    def decode(self, ids):
        return ""


def completions_for(options: SamplingOptions) -> tuple[list[Sequence], dict]:
    seqs, table = [], {}
    for row in range(BATCH):
        seq = Sequence(request_id=f"r{row}", token_ids=list(range(100 + row)), prompt_len=90, options=options,
                       arrival=row)
        request = RequestOutput(key=row, request_id=seq.request_id, sink=lambda d: None, options=options,
                                prompt_len=90, submitted_at=0.0, deadline=None, unfinished=1)
        table[seq] = Completion(0, seq, IncrementalDetokenizer(NoTokenizer(), [], ()), None, request)
        seqs.append(seq)
    return seqs, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(BATCH, VOCAB) * 3
    greedy = SamplingOptions(max_new_tokens=128, ignore_eos=True)
    paths = {
        "bare sampler (before)": (lambda: sample(logits, [greedy] * BATCH, [None] * BATCH)),
    }
    sampler = StepSampler(VOCAB, [2], torch.device("cpu"))
    for name, options in [
        ("StepSampler, every option off (W48 now)", greedy),
        ("StepSampler, logprobs=5", SamplingOptions(max_new_tokens=128, ignore_eos=True, logprobs=5)),
        ("StepSampler, repetition 1.2 + presence 0.5 + frequency 0.5",
         SamplingOptions(max_new_tokens=128, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5,
                         frequency_penalty=0.5)),
        ("StepSampler, logit_bias (4 ids) + min_tokens", SamplingOptions(
            max_new_tokens=128, ignore_eos=True, logit_bias=((1, 1.0), (2, -1.0), (3, 2.0), (4, 5.0)),
            min_tokens=100)),
        ("StepSampler, temperature 1 + min_p 0.05", SamplingOptions(max_new_tokens=128, ignore_eos=True,
                                                                    temperature=1.0, min_p=0.05)),
    ]:
        seqs, table = completions_for(options)
        if options.temperature:
            for completion in table.values():
                completion.generator = torch.Generator().manual_seed(0)
        paths[name] = (lambda seqs=seqs, table=table: sampler.sample(seqs, logits, table))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, run in paths.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["bare sampler (before)"])
    print(f"one decode step's sampling, batch {BATCH}, vocab {VOCAB}, {args.threads} threads, "
          f"median of {args.repeats} in turns\n")
    print("| path | ms a step | over the bare sampler, ms |")
    print("| --- | --- | --- |")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {1e3 * median:.3f} | {1e3 * (median - base):+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
