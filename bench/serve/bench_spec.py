"""Speculative decoding: pagedkv with and without it, against vLLM's CPU engine with and without it.

SmolLM2-135M-Instruct in float32, greedy, eos ignored (every path makes the same tokens).
Workloads, fixed seeds, drawn anew for every round at every concurrency (no request is sent
twice: its answer would be in the suffix proposer's history of earlier answers):

  - grounded: chat requests over synthetic documents of 300-1,500 tokens whose answers
    copy their input (extract invoices as JSON, quote a sentence, rewrite with small
    edits; bench/serve/spec_workloads.py), --max-new-tokens each (128);
  - free: W48's prompts (bench_generate.workload: random token ids, max_new_tokens
    8-128), redrawn each round as bench_vs_vllm.py does; little there repeats, though
    SmolLM2's greedy answers to random tokens fall into loops a proposer finds;
  - chat: open questions (explain, advise, tell a story; spec_workloads.chat) whose
    answers quote nothing and do not loop, --max-new-tokens each: the control for what
    speculation costs where it finds little.

Paths, taking turns within each round (who goes first alternates with the round):

  - pagedkv: both services as real processes (bench_vs_vllm.pagedkv_services), one per
    path, token ids in over gRPC, at most --concurrency requests in flight:
    without speculation, and with each of --methods (`--speculative-method ngram|suffix
    --num-speculative-tokens K --prompt-lookup-min --prompt-lookup-max`), and with
    --speculative-max-tokens N[,M] each of them again with lengths adapting up to N (and M);
  - vLLM: its CPU engine offline (harness/peers/vllm_worker.py, max_num_seqs =
    the concurrency), plain and with speculative_config {"method": "ngram", ...}; if its
    CPU backend refuses to speculate, the refusal is printed and the plain engine stays.

Per cell (concurrency, workload, path): median tokens/s over rounds; the medians of the
per-round ratios against pagedkv without speculation, vLLM plain and vLLM ngram; pagedkv's
decode alone (tokens after each request's first over the seconds after it) and its ratio; the
acceptance rate (accepted / proposed: pagedkv's usage.spec_*_tokens, vLLM's spec-decode
counters); tokens a stream gains per step (new tokens / (new tokens - accepted): a step
appends the accepted tokens and one more); and how many outputs equal pagedkv's without
speculation, token for token (greedy: all of pagedkv's should). The proposers' cost is
timed apart, in this process: pagedkv's proposer replayed over the outputs, one call per
token, beside a plain one-stream token's time; vLLM's is not measured.

    .venv/bin/python -m bench.serve.bench_spec [--rounds 3] [--concurrency 1,8]
        [--workloads grounded,free,chat] [--methods ngram,suffix] [--num-speculative-tokens 3]
        [--prompt-lookup-min 2] [--prompt-lookup-max 5] [--requests 64] [--max-new-tokens 128]
        [--speculative-max-tokens N[,M] [--skip-fixed]] [--skip-vllm] [--threads 2]
    .venv/bin/python -m bench.serve.bench_spec --rounds 1 --requests 4 --concurrency 1 \\
        --workloads grounded --skip-vllm           # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.serve import spec_workloads
from bench.serve.bench_generate import workload as w48_workload
from bench.serve.bench_vs_vllm import pagedkv_services, rate, redraw
from harness.peers import vllm_cores
from harness.peers.vllm_offline import VllmRefused, VllmWorker, ensure_vllm_venv, smollm2_checkpoint, tail
from harness.peers.settle import settle

from model_service.loading.embedded import embedded_model_path

VOCAB = 49152
MAX_MODEL_LEN = 2048  # the longest grounded prompt and its answer
PLAIN, VLLM, VLLM_SPEC = "pagedkv", "vLLM", "vLLM ngram"


def chat_token_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def round_requests(work: str, args, draw: int, tokenizer, max_new: int) -> list[tuple[list[int], int]]:
    """The (prompt ids, max_new_tokens) of one round at one concurrency, the `draw`-th: documents,
    questions and prompts no other round (nor the warm-up, draw -1) sent. A grounded request
    sent twice would find its whole answer in the suffix proposer's history."""
    if work == "free":
        return redraw(w48_workload()[:args.requests], draw, VOCAB)
    if work == "grounded":
        base = spec_workloads.grounded(lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
                                       args.requests, seed=draw)
    else:
        base = spec_workloads.chat(args.requests, draw)
    return [(chat_token_ids(tokenizer, messages), max_new) for messages in spec_workloads.for_round(base, draw)]


def spec_flags(method: str, args, max_tokens: int = 0) -> list[str]:
    flags = ["--speculative-method", method, "--num-speculative-tokens", str(args.num_speculative_tokens),
             "--prompt-lookup-min", str(args.prompt_lookup_min), "--prompt-lookup-max", str(args.prompt_lookup_max)]
    return flags + (["--speculative-max-tokens", str(max_tokens)] if max_tokens else [])


def spec_paths_of(methods: list[str], args) -> list[tuple[str, str, list[str]]]:
    """(path name, method, model-service flags) of each speculating path: each method at the
    fixed K (unless --skip-fixed), and with --speculative-max-tokens N also adapting up to N."""
    paths = [] if args.skip_fixed else [(f"pagedkv {m}", m, spec_flags(m, args)) for m in methods]
    longest = [int(n) for n in str(args.speculative_max_tokens).split(",") if int(n)]
    for n in longest:
        label = "adaptive" if len(longest) == 1 else f"adaptive {n}"
        paths += [(f"pagedkv {m} {label}", m, spec_flags(m, args, n)) for m in methods]
    return paths


def decode_rate(row: dict) -> float | None:
    """Tokens a second after each request's first token (its prefill left out), where known."""
    decode = row.get("decode")
    if not decode:
        return None
    seconds = sum(s for _, s in decode)
    return sum(t for t, _ in decode) / seconds if seconds > 0 else None


def spec_totals(row: dict) -> tuple[int, int]:
    """(proposed, accepted) over a run: pagedkv's per completion, vLLM's per job."""
    if "spec_totals" in row:
        return row["spec_totals"]
    return sum(p for p, _ in row.get("spec", [])), sum(a for _, a in row.get("spec", []))


@contextlib.contextmanager
def vllm_paths(python: Path, model_dir: Path, tmp: Path, args, concurrency: int):
    """{name: run(requests, concurrency)} for vLLM plain and with ngram speculation (unless refused)."""
    engines: dict[str, VllmWorker] = {}
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    try:
        for name, engine in ((VLLM, {"max_num_seqs": concurrency}),
                             (VLLM_SPEC, {"max_num_seqs": concurrency, "speculative_config": speculative})):
            log = tmp / f"vllm-{name.replace(' ', '-')}-c{concurrency}.log"
            try:
                engines[name] = VllmWorker(python, model_dir, "float32", log, args.threads,
                                           max_model_len=MAX_MODEL_LEN, engine=engine)
            except (VllmRefused, SystemExit) as refusal:  # SystemExit: its engine died at start instead
                if "speculative_config" not in engine:
                    raise
                print(f"  vLLM refused {engine}: {refusal}\n  the end of its log:\n{tail(log)}", flush=True)
        yield {name: (lambda requests, _c, worker=worker: worker.run(requests)) for name, worker in engines.items()}
        for name, worker in engines.items():
            print(f"  {name} computed on {vllm_cores.binding(worker.process.pid)}", flush=True)
    finally:
        for worker in engines.values():
            worker.close()


def proposer_cost(method: str, args, sequences: list[tuple[list[int], list[int]]]) -> float:
    """Microseconds a proposal takes, pagedkv's proposer replayed over (prompt, output) pairs in
    this process, one call a token as a one-token step makes it (suffix: the sequence's own
    trie and the history of the outputs replayed before, as spec/speculator.py asks both)."""
    from model_service.spec.ngram import NgramIndex
    from model_service.spec.request_trie import RequestTrie
    from model_service.spec.suffix import SuffixHistory

    k, low, high = args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max
    history = SuffixHistory(high + k, 65536) if method == "suffix" else None
    seconds, calls = 0.0, 0
    for prompt, output in sequences:
        started = time.perf_counter()
        own = NgramIndex(low, high, prompt) if history is None else RequestTrie(high + k)
        if history is not None:
            own.extend(prompt)
        context = list(prompt)
        seconds += time.perf_counter() - started  # the prompt's share, once a request
        for token in output:
            started = time.perf_counter()
            own.extend([token])
            context.append(token)
            if history is None:
                own.propose(k)
            else:
                own.propose_scored(context, low, high, k)
                history.propose_scored(None, context, low, high, k)
            seconds += time.perf_counter() - started
            calls += 1
        if history is not None:
            history.add(None, output)
    return 1e6 * seconds / max(calls, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", default="1,8", help="requests in flight at once, one cell each")
    parser.add_argument("--workloads", default="grounded,free")
    parser.add_argument("--methods", default="ngram,suffix", help="pagedkv's --speculative-method values to run")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--speculative-max-tokens", default="0",
                        help="N[,M...]: also each method with pagedkv's --speculative-max-tokens N (adaptive "
                             "lengths), a path for each value")
    parser.add_argument("--skip-fixed", action="store_true",
                        help="with --speculative-max-tokens: leave out the fixed-K paths")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64, help="grounded and chat requests (free: at most W48's 48)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="per grounded or chat request (free keeps W48's)")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    methods = [m for m in args.methods.split(",") if m]
    if any(c < 1 for c in concurrencies) or not set(workloads) <= {"grounded", "free", "chat"} \
            or not set(methods) <= {"ngram", "suffix"} or args.requests < 1:
        parser.error("--concurrency takes positive integers, --workloads grounded,free,chat, --methods ngram,suffix, "
                     "--requests at least 1")
    from transformers import AutoTokenizer

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    python = None if args.skip_vllm else ensure_vllm_venv()
    # vLLM reads a safetensors copy of the GGUF pagedkv's `--model smollm2` loads; then both read that copy.
    model = "smollm2" if args.skip_vllm else smollm2_checkpoint()
    spec_specs = spec_paths_of(methods, args)
    spec_paths = [name for name, _, _ in spec_specs]
    rows: dict[tuple[int, str, str], list[dict]] = {}
    prompts: dict[tuple[int, str], list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        pagedkv = {}
        for name, flags in ((PLAIN, []), *((n, flags) for n, _, flags in spec_specs)):
            (tmp / name.replace(" ", "-")).mkdir()
            pagedkv[name] = stack.enter_context(pagedkv_services(model, "float32", tmp / name.replace(" ", "-"),
                                                                 args.threads, flags, max_model_len=MAX_MODEL_LEN))
        for concurrency in concurrencies:
            with contextlib.ExitStack() as vllm_stack:
                paths = dict(pagedkv)
                if python is not None:
                    paths.update(vllm_stack.enter_context(vllm_paths(python, model, tmp, args, concurrency)))
                warm_up = round_requests(workloads[0], args, -1, tokenizer, 8)[:2]
                for run in paths.values():  # warm up, on prompts no round uses
                    run(warm_up, concurrency)
                for round_index in range(args.rounds):
                    draw = concurrencies.index(concurrency) * args.rounds + round_index
                    for work in workloads:
                        requests = round_requests(work, args, draw, tokenizer, args.max_new_tokens)
                        prompts[(round_index, work)] = [prompt for prompt, _ in requests]
                        order = list(paths.items())
                        for name, run in order if round_index % 2 == 0 else order[::-1]:
                            settle()
                            rows.setdefault((concurrency, work, name), []).append(run(requests, concurrency))
                        print(f"  concurrency {concurrency}, round {round_index + 1}, {work}: " + ", ".join(
                            f"{name} {rate(rows[(concurrency, work, name)][-1]):.0f}" for name in paths) + " tok/s",
                            flush=True)
    report(args, concurrencies, workloads, rows, prompts, spec_specs)
    return 0


def report(args, concurrencies, workloads, rows, prompts, spec_specs) -> None:
    spec_paths = [name for name, _, _ in spec_specs]
    load = os.getloadavg()
    print(f"\nSmolLM2-135M-Instruct, float32, greedy, {args.rounds} round(s), {args.threads} threads, "
          f"K={args.num_speculative_tokens}, prompt lookup {args.prompt_lookup_min}-{args.prompt_lookup_max}; "
          f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| concurrency | workload | path | tok/s (median) | vs pagedkv plain | vs vLLM plain | vs vLLM ngram "
          "| acceptance | tokens a step | decode tok/s (after first tokens) | decode vs plain "
          "| same as pagedkv plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for concurrency in concurrencies:
        for work in workloads:
            plain, theirs = rows[(concurrency, work, PLAIN)], rows.get((concurrency, work, VLLM))
            theirs_spec = rows.get((concurrency, work, VLLM_SPEC))
            for name in (PLAIN, *spec_paths, VLLM, VLLM_SPEC):
                runs = rows.get((concurrency, work, name))
                if runs is None:
                    continue
                against = (lambda others: "-" if others is None else
                           f"{statistics.median(rate(r) / rate(o) for r, o in zip(runs, others)):.2f}x")
                proposed, accepted = (sum(t) for t in zip(*map(spec_totals, runs)))
                tokens = sum(r["tokens"] for r in runs)
                same = sum(a == b for r, p in zip(runs, plain) for a, b in zip(r["outputs"], p["outputs"]))
                print(f"| {concurrency} | {work} | {name} | {statistics.median(map(rate, runs)):,.0f} | "
                      f"{against(plain)} | {against(theirs)} | {against(theirs_spec)} | "
                      f"{f'{100 * accepted / proposed:.0f} %' if proposed else '-'} | "
                      f"{tokens / (tokens - accepted):.2f} | {decode_cells(runs, plain)} | "
                      f"{same}/{sum(len(r['outputs']) for r in runs)} |")
    # What a proposal's cost compares with: a token's time, one stream, no speculation (its
    # prompt's prefill spread over its tokens: an upper bound on a decode step's time).
    print("\n| proposer | workload | us a proposal (replayed in this process) | share of a plain one-stream token |")
    print("| --- | --- | --- | --- |")
    one = min(concurrencies)
    for name, method, _ in spec_specs:
        for work in workloads:
            runs = rows[(one, work, name)]
            sequences = [(prompt, output) for round_index, run in enumerate(runs)
                         for prompt, output in zip(prompts[(round_index, work)], run["outputs"])]
            cost = proposer_cost(method, args, sequences)
            step_us = 1e6 * statistics.median(r["seconds"] / r["tokens"] for r in rows[(one, work, PLAIN)])
            print(f"| {name} | {work} | {cost:.1f} | {100 * cost / step_us:.2f} % "
                  f"(a token {step_us / 1000:.1f} ms at concurrency {one}) |")
    if not args.skip_vllm:
        print("| vLLM ngram | all | not measured | not measured |")


def decode_cells(runs: list[dict], plain: list[dict]) -> str:
    """The median decode-only rate and its median ratio against plain's, in turns; "- | -" for vLLM."""
    rates, plain_rates = [decode_rate(r) for r in runs], [decode_rate(r) for r in plain]
    if None in rates or None in plain_rates:
        return "- | -"
    ratio = statistics.median(r / p for r, p in zip(rates, plain_rates))
    return f"{statistics.median(rates):,.0f} | {ratio:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
