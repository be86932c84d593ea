"""The memory soak (checks/soak.py --requests N): both services' resident memory over N
requests of mixed shapes, sampled every --sample-every finished requests.

    .venv/bin/python -m checks.soak --requests 10000 --concurrency 8

The model service serves a tiny random Llama checkpoint with a chat template
(harness/hf_checkpoints.py), so chat and tools run too, under --api-keys with two tenants;
the cache service's pool is 64 MiB. --concurrency clients (each of one tenant, in turns)
loop until N requests have finished, each request one of SHAPES at random: streams,
n = 2, logprobs with prompt logprobs, structured output (three JSON schemas), penalties
with stop strings, stop ids and min_tokens, an HTTP completion stream, an HTTP chat call
with a named tool, an Abort by id, a deadline that passes mid-request, a client that
cancels after its first token, and a request refused by validation.

--model-flags adds flags to the model service's (for glibc's own allocator behaviour:
'--malloc-arena-max 0 --malloc-trim-interval-s 0'), --model-env NAME=VALUE sets its
environment (LD_PRELOAD=... for another allocator); compare settings with the same --seed.

Each sample reads /proc/PID/status of both services: VmRSS, and of it RssAnon (the
process's own memory) and RssShmem (pages of the shared KV pool it has touched so far:
they grow until the pool has been touched once, up to its size, and belong to the pool
the cache service reserved up front). The table gives both; the growth checked is the
model service's RssAnon from the first sample at or past --from-request to the last.
Exits 1 if it grew by --max-growth or more, a request ended with a status its shape
does not expect, or blocks stayed leased.
"""

from __future__ import annotations

import json
import random
import shlex
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from harness.processes import start_cache_service, start_model_service

from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

KEYS = {"sk-soak-tenant-a": "a", "sk-soak-tenant-b": "b"}
# A ChatML-like template that shows the tools: enough for chat and tool_choice to run.
TEMPLATE = ("{{ bos_token }}{% if tools %}<|extra|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
            "</s>\n{% endif %}{% for message in messages %}<|extra|>{{ message['role'] }}\n{{ message['content'] }}"
            "</s>\n{% endfor %}{% if add_generation_prompt %}<|extra|>assistant\n{% endif %}")
SCHEMAS = [json.dumps(schema) for schema in (
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]},
    {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
)]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssShmem")


def status_kib(pid: int) -> dict[str, int]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            found[name] = int(value.split()[0])
    return found


def row(count: int, seconds: float, model_kib: dict, cache_kib: dict) -> str:
    return (f"| {count:,} | {seconds:.0f} | {model_kib['RssAnon'] / 1024:.1f} | {model_kib['RssShmem'] / 1024:.1f} "
            f"| {model_kib['VmRSS'] / 1024:.1f} | {cache_kib['RssAnon'] / 1024:.1f} | {cache_kib['VmRSS'] / 1024:.1f} |")


class Soak:
    def __init__(self, args, model, cache, vocab: int) -> None:
        self.args = args
        self.model, self.cache = model, cache
        self.vocab = vocab
        self.lock = threading.Lock()
        self.started = 0
        self.finished = 0
        self.outcomes: Counter[str] = Counter()  # "shape: outcome"
        self.unexpected: Counter[str] = Counter()
        self.samples: list[tuple[int, float, dict, dict]] = []  # (requests, seconds, model's, cache's)
        self.began = time.monotonic()
        stub_channel = grpc.insecure_channel(model.address)
        self.stub = model_pb2_grpc.ModelServiceStub(stub_channel)

    def sample(self, count: int) -> None:
        self.samples.append((count, time.monotonic() - self.began, status_kib(self.model.pid),
                             status_kib(self.cache.pid)))
        print(row(*self.samples[-1]), file=sys.stderr, flush=True)  # the curve so far, should the run be cut short

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        key = list(KEYS)[index % len(KEYS)]
        while True:
            with self.lock:
                if self.started >= self.args.requests:
                    return
                self.started += 1
                number = self.started
            shape = rng.choices(list(SHAPES), weights=[weight for weight, _, _ in SHAPES.values()])[0]
            _, run, expected = SHAPES[shape]
            try:
                outcome = run(self, rng, key, f"soak-{index}-{number}")
            except grpc.RpcError as error:
                outcome = error.code().name
            except urllib.error.HTTPError as error:
                outcome = f"HTTP {error.code}"
            with self.lock:
                self.outcomes[f"{shape}: {outcome}"] += 1
                if outcome not in expected:
                    self.unexpected[f"{shape}: {outcome}"] += 1
                self.finished += 1
                if self.finished % self.args.sample_every == 0:
                    self.sample(self.finished)

    # -- the shapes -------------------------------------------------------------------

    def prompt(self, rng: random.Random, low: int = 4, high: int = 48) -> list[int]:
        return [rng.randrange(4, self.vocab) for _ in range(rng.randint(low, high))]

    def grpc_stream(self, key: str, request: model_pb2.GenerateRequest, timeout: float = 120.0) -> str:
        last = None
        for last in self.stub.Generate(request, timeout=timeout, metadata=bearer_metadata(key)):
            pass
        return model_pb2.FinishReason.Name(last.finish_reason)

    def sampled(self, rng: random.Random, **fields) -> model_pb2.SamplingParams:
        return model_pb2.SamplingParams(max_new_tokens=rng.randint(1, self.args.max_new_tokens), temperature=0.7,
                                        seed=rng.randrange(2**31), **fields)

    def plain(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(prompt_token_ids=self.prompt(rng),
                                                               sampling=self.sampled(rng)))

    def n_two(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(prompt_token_ids=self.prompt(rng),
                                                               sampling=self.sampled(rng, n=2)))

    def logprobs(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(
            prompt_token_ids=self.prompt(rng), sampling=self.sampled(rng, logprobs=3, prompt_logprobs=1)))

    def structured(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(prompt="Answer in JSON: ", sampling=self.sampled(
            rng, structured=model_pb2.StructuredOutputs(json=rng.choice(SCHEMAS)))))

    def penalties(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(prompt="Paged attention keeps blocks", sampling=(
            self.sampled(rng, stop=["e b", "zz"], stop_token_ids=rng.sample(range(4, self.vocab), 8), min_tokens=1,
                         frequency_penalty=0.5, repetition_penalty=1.1))))

    def aborted(self, rng, key, request_id) -> str:
        call = self.stub.Generate(model_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=self.prompt(rng),
            sampling=model_pb2.SamplingParams(max_new_tokens=400, ignore_eos=True, temperature=0.7)),
            timeout=120, metadata=bearer_metadata(key))
        last = next(call)
        self.stub.Abort(model_pb2.AbortRequest(request_ids=[request_id]), timeout=30, metadata=bearer_metadata(key))
        for last in call:
            pass
        return model_pb2.FinishReason.Name(last.finish_reason)

    def deadline(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(
            prompt_token_ids=self.prompt(rng), sampling=model_pb2.SamplingParams(max_new_tokens=400, ignore_eos=True)),
            timeout=rng.uniform(0.05, 0.3))

    def cancelled(self, rng, key, request_id) -> str:
        call = self.stub.Generate(model_pb2.GenerateRequest(prompt_token_ids=self.prompt(rng), sampling=self.sampled(
            rng, ignore_eos=True)), timeout=120, metadata=bearer_metadata(key))
        next(call)
        call.cancel()
        return "cancelled"

    def refused(self, rng, key, request_id) -> str:
        return self.grpc_stream(key, model_pb2.GenerateRequest(prompt_token_ids=[self.vocab + 10**6],
                                                               sampling=self.sampled(rng)))

    def http(self, path: str, key: str, body: dict) -> bytes:
        request = urllib.request.Request(f"{self.model.http_url}/{path}", data=json.dumps(body).encode(),
                                         method="POST", headers={"content-type": "application/json",
                                                                 "authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.read()

    def http_stream(self, rng, key, request_id) -> str:
        body = self.http("completions", key, {"model": "soak", "prompt": "The quick brown fox", "stream": True,
                                               "max_tokens": rng.randint(1, self.args.max_new_tokens),
                                               "temperature": 0.7, "seed": rng.randrange(2**31)})
        return "done" if body.rstrip().endswith(b"[DONE]") else "truncated"

    def tools(self, rng, key, request_id) -> str:
        body = json.loads(self.http("chat/completions", key, {
            "model": "soak", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 24,
            "temperature": 0.7, "seed": rng.randrange(2**31)}))
        return body["choices"][0]["finish_reason"]


FINISHED = {"FINISH_REASON_LENGTH", "FINISH_REASON_EOS", "FINISH_REASON_STOP"}
# name: (weight, run, the outcomes it may end with)
SHAPES = {
    "stream": (30, Soak.plain, FINISHED),
    "n = 2": (8, Soak.n_two, FINISHED),
    "logprobs": (8, Soak.logprobs, FINISHED),
    # RESOURCE_EXHAUSTED: a schema's first compile while the tenant's compile share is taken
    # (--grammar-compiles-per-tenant): retry later, as the error table says.
    "structured output": (8, Soak.structured, FINISHED | {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    "penalties, stops, min_tokens": (8, Soak.penalties, FINISHED),
    "HTTP stream": (8, Soak.http_stream, {"done"}),
    "HTTP tools": (6, Soak.tools, {"tool_calls", "length", "stop"}),
    "abort": (6, Soak.aborted, {"FINISH_REASON_ABORT", "FINISH_REASON_LENGTH"}),
    "deadline": (6, Soak.deadline, {"DEADLINE_EXCEEDED"}),
    "client cancel": (6, Soak.cancelled, {"cancelled"}),
    "refused": (6, Soak.refused, {"INVALID_ARGUMENT"}),
}


def run(args) -> int:
    from harness.hf_checkpoints import write_checkpoint

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedkv-memory-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = write_checkpoint("llama", workdir / "checkpoint")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({key: {"tenant": tenant} for key, tenant in KEYS.items()}))
    # The pool in /dev/shm, the default: the model service's touched pool pages are its RssShmem.
    with start_cache_service(workdir, "--kv-cache-bytes", args.kv_cache_bytes) as cache, \
            start_model_service(workdir, cache.address, "--model", checkpoint, "--api-keys", keys,
                                "--max-model-len", 512, "--served-model-name", "soak", *shlex.split(args.model_flags),
                                env=dict(item.split("=", 1) for item in args.model_env)) as model:
        metadata = bearer_metadata(next(iter(KEYS)))
        info = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address)).GetModelInfo(
            model_pb2.GetModelInfoRequest(), timeout=10, metadata=metadata)
        soak = Soak(args, model, cache, info.vocab_size)
        soak.sample(0)
        threads = [threading.Thread(target=soak.client, args=(index,), daemon=True)
                   for index in range(args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - soak.began
        cache_stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
        leased = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10).blocks_leased
        settle_until = time.monotonic() + 5
        while leased and time.monotonic() < settle_until:
            time.sleep(0.05)
            leased = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10).blocks_leased

    print(f"{args.requests} requests, {args.concurrency} clients of two tenants, {elapsed:.0f} s; "
          f"pool --kv-cache-bytes {args.kv_cache_bytes}; model service flags {args.model_flags!r}, "
          f"environment {args.model_env}; blocks leased at the end: {leased}\n")
    print("| requests | seconds | model RssAnon (MiB) | model RssShmem (MiB) | model VmRSS (MiB) "
          "| cache RssAnon (MiB) | cache VmRSS (MiB) |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for sample in soak.samples:
        print(row(*sample))
    base = next(sample for sample in soak.samples if sample[0] >= args.from_request)
    end = soak.samples[-1]
    growth = {f"{who} {field}": end[index][field] / base[index][field] - 1
              for who, index in (("model", 2), ("cache", 3)) for field in ("RssAnon", "VmRSS")}
    print(f"\nfrom request {base[0]:,} to {end[0]:,}: " + ", ".join(f"{who} {change:+.2%}"
                                                                   for who, change in growth.items()))
    print("\n| shape: outcome | count |\n| --- | ---: |")
    for name, count in sorted(soak.outcomes.items()):
        print(f"| {name} | {count} |")
    if soak.unexpected:
        print(f"\nunexpected outcomes: {dict(soak.unexpected)}")
    print(f"\nlogs: {workdir}", file=sys.stderr)
    failed = growth["model RssAnon"] >= args.max_growth or soak.unexpected or leased
    return 1 if failed else 0
