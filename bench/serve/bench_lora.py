"""LoRA serving: W48 spread over several adapters, against the same requests on the base
alone and against vLLM's CPU engine serving the same adapters.

Checkpoint: the W48 random Llama (bench_generate.py writes it), float32 and/or bfloat16.
Adapters: --adapters of rank --rank on all seven projections (q, k, v, o, gate, up,
down), written once by peft (harness/lora_adapters.py) with random factors, adapter i
from seed i, into this run's temporary directory. Workload: W48 (its first --requests
requests), request i under adapter i mod --adapters (round robin); greedy, eos ignored,
new prompt tokens every round (same lengths), so no prefix cache helps.

Paths, taking turns within each round (who goes first rotates from round to round):
  - adapters: a model service started with --lora-modules (every adapter) --max-loras
    --max-lora-rank, each request naming its adapter in GenerateRequest.lora_name;
  - base: a model service without LoRA, the same requests without adapters;
  - vLLM: its offline engine (harness/peers/vllm_worker.py in its own venv, as
    bench_vs_vllm.py runs it) with enable_lora, max_loras, max_lora_rank, each request with
    its LoRARequest. Where vLLM refuses (its CPU backend without LoRA, a dtype it does not
    take with adapters), its text is printed and the table says so.
Both model services attach to one cache service; pagedkv's requests go over gRPC from one
asyncio client in this process, streaming every token (bench_vs_vllm.py's client). The
table also counts greedy outputs that agree token for token between pagedkv and vLLM under
the same adapters (float32 should agree nearly everywhere), and between the adapters' and
the base's (few: an adapter that changed nothing would be a broken benchmark).

Also measured, once per dtype:
  - start-up: seconds until SERVING with --lora-modules and without, and the service's own
    `lora_modules_loaded` seconds (reading and checking every adapter);
  - runtime load: a third model service with --lora-load-dir, each adapter loaded by
    POST /v1/load_lora_adapter (seconds per call), its resident memory before and after;
  - memory per adapter: the resident memory (/proc/PID/status VmRSS less RssShmem: the
    service's own pages and mapped files, not the shared KV pool's) of the service with
    adapters minus the base's, over the adapter count, after the warm-up and after the
    rounds (two processes: expect noise of a few MiB); the same before and after the
    runtime loads, in one process; and pagedkv_model_lora_adapter_bytes over the count
    (the factors themselves).

    PAGEDKV_VLLM_VENV=V .venv/bin/python -m bench.serve.bench_lora [--rounds 3] [--adapters 8] [--rank 16]
        [--dtypes float32,bfloat16] [--requests 48] [--threads 2] [--skip-vllm]
    .venv/bin/python -m bench.serve.bench_lora --rounds 1 --requests 4 --skip-vllm   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.serve.bench_generate import metric, workload, write_w48_checkpoint
from bench.serve.bench_vs_vllm import agreement, grpc_runner, model_service_args, rate, redraw
from checks.memory_soak import status_kib
from harness.lora_adapters import write_adapter
from harness.peers.vllm_offline import VllmRefused, VllmWorker, ensure_vllm_venv
from harness.processes import start_cache_service, start_model_service
from harness.peers.settle import settle

VOCAB = 32000  # the W48 checkpoint's
GOALS = {"adapters / base": 0.85, "pagedkv / vLLM": 1.3}


def write_adapters(directory: Path, model_dir: Path, count: int, rank: int) -> dict[str, Path]:
    """{name: directory} of `count` rank-`rank` adapters over the checkpoint, adapter i from seed i."""
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir).eval()
    return {f"lora{i}": write_adapter(directory / f"lora{i}", base, rank=rank, alpha=rank, seed=i, scale=0.02)
            for i in range(count)}


def rss_mib(pid: int) -> float:
    """The process's resident memory less the shared KV pool's pages it touched (RssShmem):
    its anonymous pages and its mapped files (safetensors may stay mapped)."""
    status = status_kib(pid)
    return (status["VmRSS"] - status["RssShmem"]) / 1024


def timed_start(tmp: Path, cache_address: str, *args: str):
    started = time.perf_counter()
    model = start_model_service(tmp, cache_address, *args, timeout_s=900)
    return model, time.perf_counter() - started


def load_adapter(model, name: str, path: Path) -> float:
    """Seconds one POST /v1/load_lora_adapter takes (its 200 awaited)."""
    body = json.dumps({"lora_name": name, "lora_path": str(path)}).encode()
    request = urllib.request.Request(f"{model.http_url.removesuffix('/v1')}/v1/load_lora_adapter", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()
    return time.perf_counter() - started


def runtime_loads(tmp: Path, cache_address: str, service_args: list[str], adapters: dict[str, Path],
                  lora_limits: list[str]) -> dict:
    """A service with --lora-load-dir: each adapter loaded over HTTP, timed; resident memory around them."""
    load_dir = next(iter(adapters.values())).parent
    with start_model_service(tmp, cache_address, *service_args, "--lora-load-dir", str(load_dir), *lora_limits,
                             timeout_s=900) as model:
        before = rss_mib(model.pid)
        seconds = [load_adapter(model, name, path) for name, path in adapters.items()]
        return {"seconds": seconds, "rss_per_adapter": (rss_mib(model.pid) - before) / len(adapters)}


def start_vllm(python: Path | None, model_dir: Path, dtype: str, tmp: Path, threads: int, count: int, rank: int):
    """vLLM's worker with LoRA on, or (None, why not) where it is skipped or refuses."""
    if python is None:
        return None, "skipped (--skip-vllm)"
    try:
        return VllmWorker(python, model_dir, dtype, tmp / f"vllm-{dtype}.log", threads,
                          max_loras=count, max_lora_rank=rank), ""
    except VllmRefused as refusal:
        print(f"  vLLM refused enable_lora (max_loras={count}, max_lora_rank={rank}) in {dtype}: {refusal}",
              flush=True)
        return None, f"refused: {refusal}"


def one_dtype(args, dtype: str, model_dir: Path, adapters: dict[str, Path], python: Path | None, tmp: Path) -> dict:
    names, paths = list(adapters), [str(path) for path in adapters.values()]
    shapes = workload()[:args.requests]
    lora_limits = ["--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
    service_args = model_service_args(model_dir, dtype, args.threads)
    cell: dict = {"dtype": dtype, "rows": {"adapters": [], "base": [], "vllm": []}}
    with start_cache_service(tmp, "--kv-cache-bytes", "2GiB") as cache:
        print(f"{dtype}: loading {len(adapters)} adapters at run time", flush=True)
        cell["runtime"] = runtime_loads(tmp, cache.address, service_args, adapters, lora_limits)
        print(f"{dtype}: starting pagedkv without and with adapters{'' if python is None else ', and vLLM'}",
              flush=True)
        base, cell["start_base"] = timed_start(tmp, cache.address, *service_args)
        modules = [f"--lora-modules={name}={path}" for name, path in adapters.items()]
        with base, contextlib.ExitStack() as stack:
            lora, cell["start_lora"] = timed_start(tmp, cache.address, *service_args, *modules, *lora_limits)
            stack.enter_context(lora)
            cell["modules_loaded"] = next(event["seconds"] for event in lora.log_events()
                                          if event.get("event") == "lora_modules_loaded")
            vllm, cell["vllm_note"] = start_vllm(python, model_dir, dtype, tmp, args.threads, args.adapters, args.rank)
            if vllm is not None:
                stack.callback(vllm.close)
            run_base, run_lora = grpc_runner(base), grpc_runner(lora)

            def adapters_path(requests):
                return run_lora([(prompt, max_new, names[i % len(names)])
                                 for i, (prompt, max_new) in enumerate(requests)])

            def vllm_path(requests):
                return vllm.run(requests, loras=[paths[i % len(paths)] for i in range(len(requests))])

            paths_by_name = {"adapters": adapters_path, "base": run_base}
            if vllm is not None:
                paths_by_name["vllm"] = vllm_path
            for name, path in list(paths_by_name.items()):  # warm up on a whole round, on prompts no round uses
                try:
                    path(redraw(shapes, -1, VOCAB))
                except VllmRefused as refusal:  # vLLM took LoRA at start but not in a step
                    print(f"  vLLM refused a LoRA batch in {dtype}: {refusal}", flush=True)
                    cell["vllm_note"] = f"refused: {refusal}"
                    del paths_by_name[name]
            cell["rss_warm"] = (rss_mib(base.pid), rss_mib(lora.pid))
            order = list(paths_by_name.items())
            for round_index in range(args.rounds):
                requests = redraw(shapes, round_index, VOCAB)
                shift = round_index % len(order)
                for name, path in order[shift:] + order[:shift]:
                    settle()
                    cell["rows"][name].append(path(requests))
                print(f"  round {round_index + 1}: " + ", ".join(
                    f"{name} {rate(cell['rows'][name][-1]):.0f} tok/s" for name in paths_by_name), flush=True)
            cell["rss_end"] = (rss_mib(base.pid), rss_mib(lora.pid))
            cell["adapter_bytes"] = metric(lora.metrics_url, "pagedkv_model_lora_adapter_bytes")
    return cell


def ratios(numerator: list[dict], denominator: list[dict]) -> list[float]:
    return [rate(a) / rate(b) for a, b in zip(numerator, denominator)]


def same_outputs(a: list[dict], b: list[dict]) -> str:
    """How many greedy outputs agree token for token, over every round."""
    counts = [agreement(x, y) for x, y in zip(a, b)]
    return f"{sum(same for same, _ in counts)}/{sum(total for _, total in counts)}" if counts else "-"


def report(args, cells: list[dict]) -> None:
    load = os.getloadavg()
    print(f"\n{args.rounds} rounds of {args.requests} requests (W48) over {args.adapters} adapters of rank {args.rank}, "
          f"{args.threads} threads; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; "
          f"vLLM with VLLM_CPU_NUM_OF_RESERVED_CPU=0 (every core)\n")
    print("| dtype | pagedkv, adapters tok/s | pagedkv, base tok/s | vLLM CPU, adapters tok/s "
          f"| adapters / base (goal ≥{GOALS['adapters / base']}x) | every round "
          f"| pagedkv / vLLM (goal ≥{GOALS['pagedkv / vLLM']}x) | every round "
          "| same greedy outputs, pagedkv and vLLM with adapters | same as the base's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in cells:
        rows = cell["rows"]
        over_base = ratios(rows["adapters"], rows["base"])
        over_vllm = ratios(rows["adapters"], rows["vllm"])
        vllm = (f"{statistics.median(rate(r) for r in rows['vllm']):,.0f}" if rows["vllm"]
                else cell["vllm_note"].split(":")[0])
        print(f"| {cell['dtype']} | {statistics.median(rate(r) for r in rows['adapters']):,.0f} | "
              f"{statistics.median(rate(r) for r in rows['base']):,.0f} | {vllm} | "
              f"**{statistics.median(over_base):.2f}x** | {', '.join(f'{r:.2f}' for r in over_base)} | "
              + (f"**{statistics.median(over_vllm):.2f}x** | {', '.join(f'{r:.2f}' for r in over_vllm)} |"
                 if over_vllm else "- | - |")
              + f" {same_outputs(rows['adapters'], rows['vllm'])} | {same_outputs(rows['adapters'], rows['base'])} |")
    print("\n| dtype | start-up without / with adapters (s) | lora_modules_loaded (s) "
          "| runtime load per adapter, median / max (s) | RSS per adapter: started with them, warm / end "
          "| loaded at run time | adapter bytes per adapter |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cell in cells:
        count = args.adapters
        warm = (cell["rss_warm"][1] - cell["rss_warm"][0]) / count
        end = (cell["rss_end"][1] - cell["rss_end"][0]) / count
        loads = cell["runtime"]["seconds"]
        print(f"| {cell['dtype']} | {cell['start_base']:.1f} / {cell['start_lora']:.1f} | "
              f"{cell['modules_loaded']:.3f} | {statistics.median(loads):.3f} / {max(loads):.3f} | "
              f"{warm:.2f} / {end:.2f} MiB | {cell['runtime']['rss_per_adapter']:.2f} MiB | "
              f"{cell['adapter_bytes'] / count / 2**20:.2f} MiB |")
    for cell in cells:
        if cell["vllm_note"].startswith("refused"):
            print(f"\nvLLM, {cell['dtype']}: {cell['vllm_note']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=8, help="adapters loaded, and vLLM's max_loras")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's rank, and --max-lora-rank")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--requests", type=int, default=48, help="the first this many of W48's requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-vllm", action="store_true", help="pagedkv's two paths only")
    args = parser.parse_args()
    if not 1 <= args.requests <= len(workload()):
        parser.error(f"--requests is 1 to {len(workload())} (W48's requests)")
    if args.adapters < 1 or args.rank < 1:
        parser.error("--adapters and --rank are at least 1")
    python = None if args.skip_vllm else ensure_vllm_venv()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_w48_checkpoint(tmp / "w48")
        adapters = write_adapters(tmp / "adapters", model_dir, args.adapters, args.rank)
        cells = [one_dtype(args, dtype, model_dir, adapters, python, tmp) for dtype in args.dtypes.split(",")]
    report(args, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
