"""End to end: the stack `make run` starts, driven the ways the README tells a user to.

One `python -m pagedkv.stack` (defaults as `make run` has them, ports free ones) serves the
whole module. It is driven by the client CLI as a subprocess, by gRPC server reflection as
grpcurl does it (no generated stubs: descriptors fetched from the server, messages built
from them), and through /metrics; after every request the cache service must report no
leased block, and 200 requests must not grow the model service's memory.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

import grpc_generate
from harness.cache_helpers import stats, wait_for
from pagedkv.cache.v1 import cache_pb2_grpc
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0
READY = re.compile(r"(model|cache) service (127\.0\.0\.1:[0-9]+) \(metrics (http://[^)]+)\)")
MODEL_SERVICE = "pagedkv.model.v1.ModelService"
CACHE_SERVICE = "pagedkv.cache.v1.CacheService"
# Short requests: memory and leases are about the count of requests, not their length.
MAX_NEW_TOKENS = 8


class RunningStack:
    def __init__(self, process: subprocess.Popen, ready_line: str, stderr_path: Path) -> None:
        self.process = process
        self.stderr_path = stderr_path
        found = {name: (address, metrics) for name, address, metrics in READY.findall(ready_line)}
        assert set(found) == {"model", "cache"}, ready_line
        self.model_address, self.model_metrics = found["model"]
        self.cache_address, self.cache_metrics = found["cache"]
        self.channels: list[grpc.Channel] = []

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def channel(self, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address)
        self.channels.append(channel)
        return channel

    def child_pid(self, module: str) -> int:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                argv = stat.with_name("cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):  # exited while we looked
                continue
            if parent == self.process.pid and argv[1:3] == [b"-m", module.encode()]:
                return int(stat.parent.name)
        raise AssertionError(f"no {module} child of the stack (pid {self.process.pid})")


def _read_ready_line(process: subprocess.Popen, stderr_path: Path) -> str:
    output = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while b"\n" not in output:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no ready line in {READY_TIMEOUT_S}s; stderr:\n{stderr_path.read_text()}")
            if selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(process.stdout.fileno(), 65536)
                if not chunk:
                    pytest.fail(f"the stack exited {process.wait(30)} before its ready line; "
                                f"stderr:\n{stderr_path.read_text()}")
                output += chunk
    return output.decode().splitlines()[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e_stack")
    stderr_path = run_dir / "stack.stderr.log"
    # What `make run` runs, but on free ports, and with no PAGEDKV_* setting of the developer's.
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDKV_")}
    argv = [sys.executable, "-m", "pagedkv.stack", "--model", "tiny", "--cache-port", "0", "--model-port", "0",
            "--cache-metrics-port", "0", "--model-metrics-port", "0", "--model-http-port", "0"]
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                   env=environment, cwd=REPO)
    try:
        running = RunningStack(process, _read_ready_line(process, stderr_path), stderr_path)
        yield running
        for channel in running.channels:
            channel.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, running.stderr()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()


@pytest.fixture(scope="module")
def cache(stack):
    return cache_pb2_grpc.CacheServiceStub(stack.channel(stack.cache_address))


@pytest.fixture(scope="module")
def model(stack):
    return model_pb2_grpc.ModelServiceStub(stack.channel(stack.model_address))


def assert_no_leased_blocks(cache) -> None:
    """A finished request's blocks go back with the engine's next lease call: poll briefly."""
    wait_for(lambda: stats(cache).blocks_leased == 0, timeout_s=60, what="0 leased blocks after the requests")
    assert stats(cache).sequences == 0


def generate(model, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> list[model_pb2.GenerateResponse]:
    return grpc_generate.generate(model, prompt=prompt, sampling=dict(max_new_tokens=max_new_tokens), timeout=60).responses


def run_client(stack, *args: str) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDKV_")}
    return subprocess.run([sys.executable, "-m", "model_service.client", *args, "--address", stack.model_address],
                          capture_output=True, text=True, timeout=60, env=environment, cwd=REPO)


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed like `name{label="value"}`."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# -- the client CLI, as the README and the stack's ready line show it ----------------------


def test_client_cli_streams_text_and_exits_0(stack, cache):
    result = run_client(stack, "Hello", "--max-new-tokens", str(MAX_NEW_TOKENS))
    assert result.returncode == 0, result.stderr
    assert result.stdout, "the tiny model's text (meaningless, but some) goes to stdout"
    assert f"completion_tokens={MAX_NEW_TOKENS}" in result.stderr
    assert "finish_reason=LENGTH" in result.stderr
    assert_no_leased_blocks(cache)


def test_client_cli_json_prints_each_message_and_the_usage(stack, cache):
    result = run_client(stack, "Hello", "--max-new-tokens", str(MAX_NEW_TOKENS), "--json")
    assert result.returncode == 0, result.stderr
    messages = [json.loads(line) for line in result.stdout.splitlines()]
    assert sum(len(message.get("token_ids", [])) for message in messages) == MAX_NEW_TOKENS
    assert len({message["request_id"] for message in messages}) == 1
    last = messages[-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert last["usage"]["completion_tokens"] == MAX_NEW_TOKENS and last["usage"]["prompt_tokens"] > 0
    assert_no_leased_blocks(cache)


def test_client_cli_info_agrees_with_the_cache_services_sizing(stack, cache):
    from pagedkv.cache.v1 import cache_pb2

    result = run_client(stack, "--info", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    sizing = cache.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)
    assert info["model_id"] == "tiny"
    assert int(info["max_total_tokens"]) == sizing.max_total_tokens > 0
    assert info["block_size"] == sizing.block_size == 16


def test_client_cli_reports_a_bad_request_with_its_status(stack, cache):
    result = run_client(stack, "Hello", "--max-new-tokens", "0")
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr
    assert_no_leased_blocks(cache)


# -- server reflection, as grpcurl uses it --------------------------------------------------


def _list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return sorted(service.name for service in reply.list_services_response.service)


def test_reflection_lists_each_services_api_health_and_reflection(stack):
    expected_common = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert set(_list_services(stack.channel(stack.model_address))) == expected_common | {MODEL_SERVICE}
    assert set(_list_services(stack.channel(stack.cache_address))) == expected_common | {CACHE_SERVICE}


def _reflected_pool(channel: grpc.Channel) -> DescriptorPool:
    return DescriptorPool(ProtoReflectionDescriptorDatabase(channel))


def test_generate_with_a_request_built_from_reflected_descriptors(stack, cache):
    """What `grpcurl -d '{"prompt": ...}' ADDRESS pagedkv.model.v1.ModelService/Generate` does."""
    channel = stack.channel(stack.model_address)
    service = _reflected_pool(channel).FindServiceByName(MODEL_SERVICE)
    assert {method.name for method in service.methods} >= {"Generate", "GetModelInfo"}
    method = service.FindMethodByName("Generate")
    assert method.server_streaming and not method.client_streaming
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    # Not the generated classes: these come from the server's descriptors alone.
    assert request_class is not model_pb2.GenerateRequest
    request = json_format.ParseDict({"prompt": "Hello", "sampling": {"max_new_tokens": MAX_NEW_TOKENS}},
                                    request_class())
    call = channel.unary_stream(f"/{service.full_name}/{method.name}",
                                request_serializer=request_class.SerializeToString,
                                response_deserializer=response_class.FromString)
    responses = [json_format.MessageToDict(response) for response in call(request, timeout=60)]
    assert sum(len(response.get("tokenIds", [])) for response in responses) == MAX_NEW_TOKENS
    assert responses[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert responses[-1]["usage"]["completionTokens"] == MAX_NEW_TOKENS
    assert_no_leased_blocks(cache)


def test_cache_get_stats_through_reflection(stack):
    channel = stack.channel(stack.cache_address)
    service = _reflected_pool(channel).FindServiceByName(CACHE_SERVICE)
    assert {method.name for method in service.methods} == {
        "Attach", "Heartbeat", "HoldSession", "Detach", "Lease", "GetSizing", "GetStats", "ResetPrefixCache"}
    method = service.FindMethodByName("GetStats")
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_unary(f"/{service.full_name}/{method.name}",
                               request_serializer=request_class.SerializeToString,
                               response_deserializer=response_class.FromString)
    reply = json_format.MessageToDict(call(request_class(), timeout=10), always_print_fields_with_no_presence=True)
    assert int(reply["blocksTotal"]) > 0
    assert int(reply["sessions"]) == 1, "the model service is the one attached session"


# -- /metrics -------------------------------------------------------------------------------


def test_metrics_of_both_services_exist_and_move(stack, model, cache):
    model_before = scrape(stack.model_metrics)
    cache_before = scrape(stack.cache_metrics)
    for name in ["pagedkv_model_generated_tokens_total", "pagedkv_model_time_to_first_token_seconds_count",
                 "pagedkv_model_inter_token_seconds_count", "pagedkv_model_queue_length",
                 "pagedkv_model_cache_connected"]:
        assert name in model_before, f"{name} missing from the model service's /metrics"
    assert model_before["pagedkv_model_cache_connected"] == 1
    for state in ["total", "free", "leased", "cached"]:
        assert f'pagedkv_cache_blocks{{state="{state}"}}' in cache_before
    assert cache_before['pagedkv_cache_blocks{state="total"}'] == stats(cache).blocks_total > 0
    assert cache_before["pagedkv_cache_sessions"] == 1

    for index in range(3):
        generate(model, f"metrics {index}")
    assert_no_leased_blocks(cache)

    model_after = scrape(stack.model_metrics)
    cache_after = scrape(stack.cache_metrics)
    moved = {name: model_after[name] - model_before[name] for name in [
        "pagedkv_model_generated_tokens_total", "pagedkv_model_time_to_first_token_seconds_count",
        "pagedkv_model_inter_token_seconds_count", 'pagedkv_model_requests_total{finish_reason="length"}']}
    assert moved == {
        "pagedkv_model_generated_tokens_total": 3 * MAX_NEW_TOKENS,
        "pagedkv_model_time_to_first_token_seconds_count": 3,
        "pagedkv_model_inter_token_seconds_count": 3 * (MAX_NEW_TOKENS - 1),
        'pagedkv_model_requests_total{finish_reason="length"}': 3,
    }
    allocations = 'pagedkv_cache_lease_ops_total{op="allocate",status="LEASE_STATUS_OK"}'
    releases = 'pagedkv_cache_lease_ops_total{op="release",status="LEASE_STATUS_OK"}'
    assert cache_after[allocations] - cache_before.get(allocations, 0) >= 3
    assert cache_after[releases] - cache_before.get(releases, 0) >= 3
    assert cache_after['pagedkv_cache_blocks{state="leased"}'] == 0


# -- the pool mapped ahead of use -------------------------------------------------------------


def _pool_mapping(pid: int) -> tuple[int, int] | None:
    """(size, resident bytes) of the model service's mapping of the pool file, from smaps."""
    mapping = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header line
            mapping = [0, 0] if re.search(r"/pagedkv-\d+-[0-9a-f]+\.kv$", fields[5]) else None
        elif mapping is not None and fields[0] in ("Size:", "Rss:"):
            mapping[fields[0] == "Rss:"] = int(fields[1]) * 1024
            if fields[0] == "Rss:":
                return mapping[0], mapping[1]
    return None


def test_the_model_service_maps_the_whole_pool_ahead_of_its_prompts(stack, cache):
    """A fresh block's first touch would cost the engine thread a fault and a page clear a
    page: the model service populates its view of the pool on a thread of its own."""
    model_pid = stack.child_pid("model_service")
    deadline = time.monotonic() + 120
    while True:
        found = _pool_mapping(model_pid)
        assert found is not None, "no mapping of the pool's file in the model service"
        size, resident = found
        if resident >= size or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert size >= 2**20 and resident == size, f"{resident:,} of the pool's {size:,} bytes mapped"


# -- many requests: no lease and no memory left behind ---------------------------------------


def _rss_bytes(pid: int) -> int:
    """The process's own resident memory (RssAnon).

    VmRSS also counts pages of the shared KV pool as the model service first touches
    them: the ledger hands out least recently used blocks, so RSS climbs by a block's
    pages for each new request until the whole pool has been touched once. Those pages
    belong to the cache service's pool, sized up front; what must not grow is the model
    service's private memory.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def test_two_hundred_requests_leave_no_leases_and_do_not_grow_the_model_service(stack, model, cache):
    model_pid = stack.child_pid("model_service")

    def one(index: int) -> int:
        responses = generate(model, f"req {index}")
        assert responses[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
        return responses[-1].usage.completion_tokens

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(one, range(10))) == [MAX_NEW_TOKENS] * 10
        assert_no_leased_blocks(cache)
        baseline = _rss_bytes(model_pid)
        for batch in range(4):
            completed = list(pool.map(one, range(10 + 50 * batch, 10 + 50 * (batch + 1))))
            assert completed == [MAX_NEW_TOKENS] * 50
            assert_no_leased_blocks(cache)
    after = _rss_bytes(model_pid)
    assert after <= baseline * 1.05, (
        f"model service private RSS grew from {baseline / 2**20:.1f} MiB after 10 requests to "
        f"{after / 2**20:.1f} MiB after 210 ({after / baseline - 1:+.1%})")
