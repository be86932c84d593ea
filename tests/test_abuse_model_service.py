"""Abuse of the model service's request surfaces, each refused with the status of the error
table and a message naming its limit, while the service stays responsive and leaks no block.

One cache service and one model service (a tiny Hugging Face checkpoint with a Hermes-style
chat template, --api-keys with three tenants and --auth-token, small limits) serve the whole
module; the tests talk to them with urllib, the `openai` package and gRPC stubs. "Off the
event loop" is shown by /health answering while a slow grammar compiles: a bounded wait
that fails only on a stall of many seconds, never a measured time. A few surfaces are plain
code (the chat template's budget, the GGUF reader, the keys file's mode, the tool-call
parser, which runs in a child process so a runaway parse ends with it).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading

import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import openai
import pytest
import torch

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

MODEL = "abuse"
KEY_A, KEY_B, KEY_OPS, KEY_LATER = "sk-abuse-tenant-a", "sk-abuse-tenant-b", "sk-abuse-ops", "sk-abuse-later"
TOKEN = "sk-abuse-auth-token"  # --auth-token: no tenant, an admin
KEYS = {KEY_A: {"tenant": "a", "max_concurrent_requests": 2}, KEY_B: {"tenant": "b"},
        KEY_OPS: {"tenant": "ops", "admin": True}}
MAX_PROMPTS, COMPILE_THREADS, MAX_DEPTH, TIMEOUT_S = 4, 2, 250, 1.0
TEMPLATE = ("{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
            "{% for message in messages %}<|extra|>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|extra|>assistant\n{% endif %}")
# Long enough for several full blocks: the prefix cache keys whole blocks.
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. A block table maps positions. " * 2
HEALTH_STALL_S = 10.0  # /health answers in milliseconds; only a stall this long fails a test


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("abuse")
    checkpoint = write_checkpoint("llama", tmp / "checkpoint")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    keys.chmod(0o600)
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", str(checkpoint), "--served-model-name", MODEL,
                                "--api-keys", str(keys), "--auth-token", TOKEN,
                                "--max-prompts-per-request", str(MAX_PROMPTS),
                                "--grammar-compile-threads", str(COMPILE_THREADS),
                                "--grammar-compile-timeout-s", str(TIMEOUT_S), "--max-json-schema-depth", str(MAX_DEPTH),
                                "--grammar-compiles-per-tenant", "1") as model:
        yield cache, model, keys


@dataclass(frozen=True)
class Answer:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def call(model, path: str, key: str, body: dict | str | None = None, timeout: float = 120) -> Answer:
    """One HTTP call (a POST when it has a body), whatever its status."""
    content = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(model.http_url.removesuffix("/v1") + path, data=content,
                                     headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.read().decode())


def post(model, path: str, key: str, body: dict | str) -> Answer:
    return call(model, path, key, body)


def error_of(response: Answer) -> str:
    return response.json()["error"]["message"]


def no_block_leased(cache) -> None:
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def client(model, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=model.http_url, api_key=key, max_retries=0, timeout=120)


# A prompt list over the cap, and a body counted whole against its tenant's limit.

def test_a_prompt_list_past_the_cap_is_400_naming_the_flag(services):
    cache, model, _ = services
    response = post(model, "/v1/completions", KEY_B, {"model": MODEL, "prompt": ["hi"] * (MAX_PROMPTS + 1),
                                                      "max_tokens": 1})
    assert response.status_code == 400
    assert f"at most {MAX_PROMPTS} in one body (--max-prompts-per-request)" in error_of(response)
    no_block_leased(cache)


def test_every_prompt_counts_against_the_tenant_before_any_is_validated(services):
    cache, model, _ = services
    # The first prompt is invalid: validating it would say so. Three prompts for a tenant
    # allowed two are refused before that, as a body that can never run (400, not 429).
    prompts = [[10**6], [5, 6], [7, 8]]
    response = post(model, "/v1/completions", KEY_A, {"model": MODEL, "prompt": prompts, "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["code"] == "resource_exhausted"
    assert "tenant 'a' has 0 requests open and this call asks for 3 more, its max_concurrent_requests is 2 " \
           "(--api-keys); send at most 2 prompts in one body" in error_of(response)
    no_block_leased(cache)


# Grammars: depth checked before compiling, a timeout, stragglers bounded, off the loop.

def nested_arrays(depth: int, leaf: str = "string") -> dict:
    schema: dict = {"type": leaf}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def slow_schema(seed: int) -> dict:
    """Several times TIMEOUT_S to compile on any machine the suite runs on, idle or loaded
    (xgrammar's time grows with the cube of the nesting and with the properties, which it
    spreads over two threads), under the depth limit. No more than that: each straggler
    holds a compile thread until it ends, and the test waits for one."""
    leaves = ["string", "integer", "boolean", "number", "null"]
    return {"type": "object", "properties": {f"p{seed}_{index}": nested_arrays(MAX_DEPTH - 10, leaves[index % 5])
                                             for index in range(5)}}


def structured(model, key: str, schema: dict) -> Answer:
    return post(model, "/v1/completions", key, {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                "structured_outputs": {"json": schema}})


def test_a_schema_nested_past_the_depth_limit_is_400_before_compiling(services):
    cache, model, _ = services
    response = structured(model, KEY_B, nested_arrays(MAX_DEPTH + 50))
    assert response.status_code == 400
    assert f"nests objects and arrays {MAX_DEPTH + 51} deep; this server compiles at most {MAX_DEPTH} " \
           "(--max-json-schema-depth)" in error_of(response)
    with grpc.insecure_channel(model.address) as channel:
        request = model_pb2.GenerateRequest(prompt="hi", sampling=model_pb2.SamplingParams(
            max_new_tokens=2, structured=model_pb2.StructuredOutputs(json=json.dumps(nested_arrays(MAX_DEPTH + 50)))))
        with pytest.raises(grpc.RpcError) as error:
            list(model_pb2_grpc.ModelServiceStub(channel).Generate(request, timeout=60,
                                                                   metadata=bearer_metadata(KEY_B)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-json-schema-depth" in error.value.details()
    no_block_leased(cache)


def health_answers(model) -> bool:
    return call(model, "/health", "", timeout=HEALTH_STALL_S).status_code == 200


def test_slow_compiles_time_out_and_their_stragglers_are_bounded_while_the_service_answers(services):
    cache, model, _ = services
    # Two slow schemas at once, from tenant a and from the --auth-token key (no tenant).
    answers = {}
    senders = [threading.Thread(target=lambda key=key, seed=seed: answers.__setitem__(key, structured(
        model, key, slow_schema(seed)))) for key, seed in ((KEY_A, 1), (TOKEN, 2))]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    for answer in answers.values():
        assert answer.status_code == 400
        assert f"did not compile within {TIMEOUT_S:g} s (--grammar-compile-timeout-s)" in error_of(answer)
    # Both still compile (a thread cannot be stopped), holding both compile threads, each
    # with the threads xgrammar started from it at SCHED_IDLE: CPU the engine does not want.
    wait_for(lambda: straggling(model) == 2, 30, "both stragglers to move to SCHED_IDLE")
    policies = compile_threads(model)
    assert policies and all(policy == SCHED_IDLE for policy in policies.values()), policies
    # Meanwhile the service answers, and a plain prompt is tokenized and generated.
    assert health_answers(model)
    plain = client(model, KEY_B).completions.create(model=MODEL, prompt="hello there", max_tokens=2,
                                                    extra_body={"ignore_eos": True})  # sampled: no early eos
    assert plain.choices[0].finish_reason == "length"
    # A new grammar waits for a thread: 429, naming the tenant's share or the pool's size.
    mine = structured(model, KEY_A, {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert mine.status_code == 429 and "--grammar-compiles-per-tenant 1" in error_of(mine)
    anyone = structured(model, KEY_B, {"type": "object", "properties": {"b": {"type": "integer"}}})
    assert anyone.status_code == 429 and f"--grammar-compile-threads {COMPILE_THREADS}" in error_of(anyone)
    # The slow schema again is refused at once while its compile runs.
    again = structured(model, KEY_A, slow_schema(1))
    assert again.status_code == 400 and "still compiling" in error_of(again)
    assert health_answers(model)
    # Once a straggler ends its grammar is cached: the slow schema costs nothing now.
    wait_for(lambda: structured(model, KEY_A, slow_schema(1)).status_code == 200, 300, "the straggler to end",
             poll_s=0.5)
    no_block_leased(cache)


SCHED_IDLE = 5  # os.SCHED_IDLE, as /proc/PID/task/TID/stat gives it


def compile_threads(model) -> dict[int, int]:
    """The model service's grammar compiles' threads (named grammar-TID by the compile, a
    name xgrammar's threads inherit) and their scheduling policies."""
    from harness.cpu_use import thread_stats

    return {tid: policy for tid, (name, _, policy) in thread_stats(model.pid).items() if name.startswith("grammar-")}


def straggling(model) -> float:
    from checks.soak import metric

    return metric(model.metrics_url, "pagedkv_model_grammar_compiles_straggling")


# Tool calls: the parser scans, it does not backtrack.

def parse_runs_of_whitespace() -> None:
    from model_service.api.openai_http.tools import parse_hermes

    text = "<tool_call>" + " " * 200_000
    assert parse_hermes(text) == (text, [])
    calls = parse_hermes("<tool_call>" + " " * 200_000 + '{"name": "f", "arguments": {}}</tool_call>')[1]
    assert [call["function"]["name"] for call in calls] == ["f"]


def test_the_tool_call_parser_is_linear_in_a_run_of_whitespace():
    import model_service.api.openai_http.tools  # noqa: F401 - imported here, not in the child

    # In a forked child (no new interpreter to import torch again): a backtracking parse
    # holds the GIL for hours, so only another process can give up on it.
    child = multiprocessing.get_context("fork").Process(target=parse_runs_of_whitespace)
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, "the parse failed or was still running after 60 s"


# Tenants: cache namespaces, the admin's reset, the keys file.

def cached_tokens(model, key: str, salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    answer = client(model, key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra)
    return answer.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_cannot_reach_another_s_cached_prefixes_with_its_salt(services):
    _, model, _ = services
    cached_tokens(model, KEY_A, "shared")
    assert cached_tokens(model, KEY_A, "shared") > 0  # its own salt hits
    assert cached_tokens(model, KEY_B, "shared") == 0  # the same salt, another tenant: nothing
    cached_tokens(model, KEY_A, None)
    assert cached_tokens(model, KEY_B, "a") == 0  # the other's name, its old default salt: nothing
    assert cached_tokens(model, TOKEN, "a") == 0


def test_only_an_admin_resets_the_prefix_cache(services):
    _, model, _ = services
    for path in ("/reset_prefix_cache", "/flush_cache"):
        refused = post(model, path, KEY_B, {})
        assert refused.status_code == 403 and "admin" in error_of(refused)
    for key in (KEY_OPS, TOKEN):
        assert post(model, "/reset_prefix_cache", key, {}).status_code == 200


def test_a_keys_file_others_can_read_is_loaded_with_a_warning(tmp_path):
    from structlog.testing import capture_logs

    from model_service.api.tenants import load_api_keys

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    keys.chmod(0o600)
    with capture_logs() as quiet:
        load_api_keys(keys)
    keys.chmod(0o644)
    with capture_logs() as warned:
        load_api_keys(keys)
    assert not quiet
    assert [event["event"] for event in warned] == ["api_keys_file_readable_by_others"]
    assert warned[0]["mode"] == "0o644" and "chmod 600" in warned[0]["fix"]


# Small surfaces: /tokenize's text, chat_template_kwargs' size.

def test_tokenize_answers_a_lone_surrogate_with_400(services):
    _, model, _ = services
    response = post(model, "/tokenize", KEY_B, '{"model": "%s", "prompt": "a\\ud800b"}' % MODEL)
    assert response.status_code == 400 and "lone UTF-16 surrogate" in error_of(response)


def test_chat_template_kwargs_count_against_the_prompt_byte_cap(services):
    cache, model, _ = services
    response = post(model, "/v1/chat/completions", KEY_B, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template_kwargs": {"padding": "x" * 40_000}})
    assert response.status_code == 400
    assert "the messages' text with chat_template_kwargs is at least" in error_of(response)
    assert "--max-prompt-tokens" in error_of(response)
    no_block_leased(cache)


# Plain code: the chat template's size budget, the GGUF layer count.

@pytest.mark.parametrize("source", [
    '{% set s = "x" * 2000 %}{{ s|replace("x", s)|length }}',
    '{% set s = "x" * 2000 %}{{ s.replace("x", s)|length }}',
    '{% set s = "x" * 2000 %}{{ ([s] * 2000)|join|length }}',
    '{% set s = "x" * 2000 %}{{ "-".join([s] * 2000)|length }}',
    '{% set s = "\n" * 2000 %}{{ s|indent(2000)|length }}',
    '{{ "x".ljust(4000000)|length }}',
], ids=["replace-filter", "replace-method", "join-filter", "join-method", "indent", "ljust-method"])
def test_a_template_result_past_the_budget_is_refused_before_it_is_built(source):
    from model_service.text.chat_template import ChatTemplate, ChatTemplateError

    with pytest.raises(ChatTemplateError, match="would build a string of [0-9,]+ characters; the limit is 100,000"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}], max_chars=100_000)


def test_a_gguf_claiming_more_layers_than_it_holds_is_refused_before_building_them(tmp_path):
    from gguf_checkpoints import write_gguf

    from model_service.errors import ModelLoadError
    from model_service.loading.loader import load_model

    path, model = write_gguf(tmp_path / "layers.gguf", "F32", metadata={"llama.block_count": 3_000_000})
    layers = model.config.num_hidden_layers
    with pytest.raises(ModelLoadError, match=f"llama.block_count is 3,000,000 but the file holds the tensors of "
                                             f"{layers} layers"):
        load_model(str(path), torch.float32, "cpu")


# Last: it rewrites the module's keys file (and puts it back).

def test_sighup_reloads_the_keys_and_requests_in_flight_keep_their_tenant(services):
    _, model, keys = services
    in_flight = client(model, KEY_B).completions.create(model=MODEL, prompt="hold", max_tokens=40, stream=True,
                                                         extra_body={"ignore_eos": True})
    chunks = iter(in_flight)
    next(chunks)  # b's request runs
    # The new tenant's compute budget reaches the engine with its key: its prompt, longer
    # than the bucket holds, is held back in steps (deferred) rather than run at once.
    keys.write_text(json.dumps({KEY_A: KEYS[KEY_A], KEY_LATER: {"tenant": "later", "max_tokens_per_s": 50}}))
    try:
        os.kill(model.pid, signal.SIGHUP)
        wait_for(lambda: models_status(model, KEY_LATER) == 200, 30, "the new key to work")
        assert models_status(model, KEY_B) == 401
        rest = list(chunks)  # the request b started before the reload runs to its end
        assert rest[-1].choices[0].finish_reason == "length"
        later = client(model, KEY_LATER).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert later.usage.prompt_tokens > 50
        assert deferred_tokens(model).get("later", 0) > 0
        assert model.returncode is None
    finally:
        keys.write_text(json.dumps(KEYS))
        os.kill(model.pid, signal.SIGHUP)
    wait_for(lambda: models_status(model, KEY_B) == 200, 30, "the key to work again")


def deferred_tokens(model) -> dict[str, float]:
    from checks.soak import label_samples

    return label_samples(model.metrics_url, "pagedkv_model_tenant_budget_deferred_tokens_total")


def models_status(model, key: str) -> int:
    return call(model, "/v1/models", key, timeout=30).status_code
