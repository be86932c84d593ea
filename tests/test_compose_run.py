"""docker-compose.yml for real, with each Compose CLI installed, where a Docker engine answers.

Builds the image, brings the stack up and waits until Docker calls both containers
healthy, generates over the published gRPC port, lists the models over the published
HTTP port, restarts the model container (the prefix cached before still hits: same cache
container, same pool), SIGKILLs the cache service (the model service fails to map the
new pool from its stale /dev/shm, detaches, exits and is brought back by its restart
policy, so both are healthy again with no depends_on restart key), then stops the stack
(both exit 0, the model service detached) and `down` exits 0. Skipped, with the reason,
where no engine or no CLI is found.

The run uses its own project name, free host ports, and an image tag of its own, so a
stack the developer runs is left alone. The first build downloads the dependencies
(minutes); later runs reuse the build cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from compose_cli import COMPOSE_CLI_HINT, compose_cli, compose_version, docker_engine

from harness.processes import free_port
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 1800
HEALTHY_TIMEOUT_S = 300
IMAGE = "pagedkv:compose-test"
PROMPT = [4 + (i * 7) % 250 for i in range(40)]  # two and a half 16-token blocks
# Run in the cache container: SIGKILL the cache service (its init's child, pid 1 ignores it).
KILL_CACHE_SERVICE = """
import os, signal
for pid in filter(str.isdigit, os.listdir("/proc")):
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        if cmdline.read().split(b"\\0")[:3] == [b"python", b"-m", b"cache_service"]:
            os.kill(int(pid), signal.SIGKILL)
            raise SystemExit(0)
raise SystemExit("no cache_service process in the cache container")
"""

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)


class Stack:
    """One compose project of docker-compose.yml (plus an override naming the test image)."""

    def __init__(self, command: list[str], tmp_path: Path) -> None:
        self.project = f"pagedkv-test-{os.getpid()}"
        override = tmp_path / "docker-compose.test.yml"
        override.write_text(f"services:\n  cache:\n    image: {IMAGE}\n  model:\n    image: {IMAGE}\n")
        self.command = [*command, "-p", self.project, "-f", str(REPO / "docker-compose.yml"), "-f", str(override)]
        self.model_port = free_port()
        self.http_port = free_port()
        self.env = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDKV_")}
        self.env.update({
            "PAGEDKV_MODEL_HOST_PORT": str(self.model_port),
            "PAGEDKV_MODEL_HTTP_HOST_PORT": str(self.http_port),
            "PAGEDKV_CACHE_HOST_PORT": str(free_port()),
            "PAGEDKV_MODEL_METRICS_HOST_PORT": str(free_port()),
            "PAGEDKV_CACHE_METRICS_HOST_PORT": str(free_port()),
            "PAGEDKV_KV_CACHE_BYTES": "32MiB",
            "PAGEDKV_SHM_SIZE": "128mb",
        })
        self.containers: dict[str, str] = {}

    def run(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.command, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                                timeout=timeout_s)
        if check:
            assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr}\n{self.logs()}"
        return result

    def logs(self, service: str = "") -> str:
        result = subprocess.run([*self.command, "logs", "--no-color", *([service] if service else [])], cwd=REPO,
                                env=self.env, capture_output=True, text=True, timeout=60)
        return result.stdout[-20000:]

    def up(self) -> None:
        self.run("up", "-d", timeout_s=600)
        for service in ("cache", "model"):
            self.containers[service] = self.run("ps", "-q", service).stdout.strip()
            assert self.containers[service], f"no {service} container:\n{self.logs()}"

    def inspect(self, service: str) -> dict:
        result = subprocess.run(["docker", "inspect", self.containers[service]], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)[0]

    def wait_healthy(self, since: dict[str, str] | None = None) -> None:
        """Until Docker calls both healthy; `since` (service -> StartedAt) waits for a new start too."""
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        while True:
            states = {service: self.inspect(service) for service in ("cache", "model")}
            summary = {service: (info["State"]["Status"], info["State"].get("Health", {}).get("Status"))
                       for service, info in states.items()}
            restarted = all(states[service]["State"]["StartedAt"] != started for service, started in (since or {}).items())
            if restarted and all(health == "healthy" for _, health in summary.values()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"not both healthy within {HEALTHY_TIMEOUT_S}s: {summary}\n{self.logs()}")
            time.sleep(1)

    def started_at(self, service: str) -> str:
        return self.inspect(service)["State"]["StartedAt"]

    def generate(self) -> model_pb2.GenerateResponse:
        request = model_pb2.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=model_pb2.SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        with grpc.insecure_channel(f"127.0.0.1:{self.model_port}") as channel:
            responses = list(model_pb2_grpc.ModelServiceStub(channel).Generate(request, timeout=120))
        last = responses[-1]
        assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 4, last
        return last


@pytest.fixture
def engine_version() -> str:
    version, why_not = docker_engine()
    if version is None:
        pytest.skip(why_not)
    return version


@pytest.mark.parametrize("generation", ["v2", "v1"], ids=["compose-v2", "docker-compose-v1"])
def test_the_stack_runs_recovers_and_stops_cleanly(generation, engine_version, tmp_path):
    command = compose_cli(generation)
    if command is None:
        pytest.skip(f"no Compose {generation} CLI on this machine ({COMPOSE_CLI_HINT[generation]})")
    print(f"Docker Engine {engine_version}, Compose {compose_version(command)} ({' '.join(command)})")
    stack = Stack(command, tmp_path)
    try:
        stack.run("build", timeout_s=BUILD_TIMEOUT_S)
        stack.up()
        stack.wait_healthy()
        first = stack.generate()
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/v1/models", timeout=60) as response:
            assert response.status == 200 and json.load(response)["data"], "the OpenAI HTTP API is not published"

        # A restarted model service re-attaches to the same pool: the prefix still hits.
        model_started = stack.started_at("model")
        stack.run("restart", "model", timeout_s=120)
        stack.wait_healthy(since={"model": model_started})
        again = stack.generate()
        assert again.usage.cached_tokens >= 32 > first.usage.cached_tokens, (first.usage, again.usage)

        # The cache container dies: the model service cannot map the new pool from the old
        # /dev/shm, gives its session back, exits, and its restart policy brings it back.
        started = {service: stack.started_at(service) for service in ("cache", "model")}
        # SIGKILL from inside, as a crash: `docker kill` would count as a manual stop, which
        # restart policies leave stopped.
        killed = subprocess.run(["docker", "exec", stack.containers["cache"], "python", "-c", KILL_CACHE_SERVICE],
                                capture_output=True, text=True, timeout=60)
        assert killed.returncode == 0, killed.stderr
        stack.wait_healthy(since=started)
        assert "pool_unmappable_detached" in stack.logs("model"), stack.logs("model")
        stack.generate()

        stack.run("stop", timeout_s=120)
        for service in ("cache", "model"):
            assert stack.inspect(service)["State"]["ExitCode"] == 0, stack.logs(service)
        assert '"detached"' in stack.logs("model"), stack.logs("model")
        down = stack.run("down", timeout_s=120, check=False)
        assert down.returncode == 0, down.stderr
    finally:
        stack.run("down", "--remove-orphans", timeout_s=120, check=False)
