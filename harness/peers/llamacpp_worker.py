"""llama.cpp (llama-cpp-python), driven one job at a time over stdin/stdout (JSON lines).

Runs in the llama.cpp venv (bench/.venv-llamacpp), never the project's: llamacpp.py's
LlamaCppWorker starts it as a child process, so the model stays loaded across rounds and takes turns with
pagedkv.

    argv: serve GGUF_PATH THREADS N_BATCH
      stdin, one job a line:    {"prompt": [token ids], "max_new_tokens": n}
      stdout, one reply a line: {"prompt_seconds": s, "decode_seconds": s, "tokens": [ids]}
    argv: quantize SOURCE_GGUF TARGET_GGUF FTYPE THREADS
      llama.cpp's own quantizer (llama_model_quantize, as its llama-quantize tool runs it);
      FTYPE is a llama_ftype value (7: MOSTLY_Q8_0). Exits 0 once TARGET is written.

Greedy, eos ignored, token ids in and out (no tokenizer, no chat template: the bench sends
the ids pagedkv's chat template makes). prompt_seconds runs from the call to the first
generated token (prompt eval and one sample); decode_seconds from the first generated token
to the last, as bench/serve/bench_quantized.py times pagedkv's stream.
"""

from __future__ import annotations

import json
import os
import sys
import time


def serve(path: str, threads: int, n_batch: int) -> int:
    # Replies get a private copy of stdout; fd 1 becomes stderr, so whatever llama.cpp
    # prints cannot end up among the replies.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    reply.write(json.dumps({"ready": True, "version": llama_cpp.__version__, "system_info": system_info}) + "\n")
    reply.flush()
    for line in sys.stdin:
        job = json.loads(line)
        # No KV kept from the last job: generate() would otherwise reuse its longest
        # common prefix, which pagedkv's rounds are built to avoid.
        llm.reset()
        tokens, times = [], []
        started = time.perf_counter()
        # generate() yields each sampled token before evaluating it and never stops on
        # eos by itself (create_completion does): eos is ignored by construction.
        for token in llm.generate(job["prompt"], temp=0.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == job["max_new_tokens"]:
                break
        reply.write(json.dumps({"prompt_seconds": times[0] - started, "decode_seconds": times[-1] - times[0],
                                "tokens": tokens}) + "\n")
        reply.flush()
    return 0


def quantize(source: str, target: str, ftype: int, threads: int) -> int:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if status != 0:
        print(f"llama_model_quantize returned {status}", file=sys.stderr)
    return 1 if status else 0


def main() -> int:
    command, *args = sys.argv[1:]
    if command == "serve":
        return serve(args[0], int(args[1]), int(args[2]))
    if command == "quantize":
        return quantize(args[0], args[1], int(args[2]), int(args[3]))
    raise SystemExit(f"unknown command {command!r}: expected serve or quantize")


if __name__ == "__main__":
    sys.exit(main())
