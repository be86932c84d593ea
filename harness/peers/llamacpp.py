"""llama.cpp as a peer: llama-cpp-python in a venv of its own (never a dependency of the
project), driven one job at a time by llamacpp_worker.py in a child process, so the model
stays loaded and takes turns with pagedkv. The venv lives under bench/ (bench/.venv-llamacpp,
in .gitignore) unless PAGEDKV_LLAMACPP_VENV names one. PAGEDKV_LLAMACPP_CMAKE_ARGS replaces
the build's CMake flags, e.g. an AVX2 build on an AVX-512 machine, to compare with pagedkv's
AVX2 level: "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=OFF" (in a venv of its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.peers.json_lines_child import JsonLinesChild
from harness.peers.places import BENCH, PEERS

LLAMACPP_VENV = Path(os.environ.get("PAGEDKV_LLAMACPP_VENV", BENCH / ".venv-llamacpp"))
LLAMACPP_VERSION = "0.3.36"
LLAMACPP_WORKER = PEERS / "llamacpp_worker.py"
LLAMACPP_CMAKE_ARGS = os.environ.get("PAGEDKV_LLAMACPP_CMAKE_ARGS", "-DGGML_NATIVE=ON")


def ensure_llamacpp_venv() -> Path:
    """The llama.cpp venv's python, the venv made first when it is missing: llama-cpp-python
    built from source (cmake) with -march=native, so llama.cpp gets this CPU's AVX-512 and
    VNNI as its own build would (or with PAGEDKV_LLAMACPP_CMAKE_ARGS). The build runs at nice 19."""
    python = LLAMACPP_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    print(f"creating {LLAMACPP_VENV} with llama-cpp-python=={LLAMACPP_VERSION}, built from source "
          f"with {LLAMACPP_CMAKE_ARGS} (several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", LLAMACPP_VENV], check=True)
    env = dict(os.environ, CMAKE_ARGS=LLAMACPP_CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    subprocess.run(["nice", "-n", "19", python, "-m", "pip", "install", "-q", "--no-cache-dir",
                    f"llama-cpp-python=={LLAMACPP_VERSION}"], check=True, env=env)
    return python


class LlamaCppWorker(JsonLinesChild):
    name = "llama.cpp"
    hint = "; a silent death on a prompt may be its multi-token batch: try --llamacpp-n-batch 1"

    def __init__(self, python: Path, path: Path, threads: int, n_batch: int, log_path: Path) -> None:
        super().__init__([str(python), str(LLAMACPP_WORKER), "serve", str(path), str(threads),
                          str(n_batch)], log_path)
        self.info = self.ready

    def one_stream(self, prompt: list[int], max_new_tokens: int) -> dict:
        reply = self.ask({"prompt": prompt, "max_new_tokens": max_new_tokens}, "stopped mid-stream")
        return {"decode": (len(reply["tokens"]) - 1) / reply["decode_seconds"],
                "prompt": len(prompt) / reply["prompt_seconds"], "tokens": reply["tokens"]}
