"""LoRA adapters loaded and unloaded at run time by a real model service (--lora-load-dir,
--max-loras 2, --api-keys with three tenants), through vLLM's HTTP endpoints and their gRPC
twins: vLLM's bodies, statuses and texts; /v1/models and the per-adapter /metrics series
follow loads and unloads; every bad load (outside the directory, through a symbolic link,
missing, huge files, duplicate name, no free slot, no right) is refused and leaves nothing
behind; an adapter unloaded under a running request keeps its slot and bytes until that
request ends; a tenant's `loras` hides the others as unknown models; KV events of an
adapter's blocks carry its name."""

from __future__ import annotations

import contextlib
import json
import os
import threading

import grpc
import urllib.error
import urllib.request
from dataclasses import dataclass
import openai
import pytest
import torch

import grpc_generate
from cache_service.events.kv_events import BlockStored, decode_batch
from harness.cache_helpers import allocate, attach, cache_stub, lease, no_block_leased, release, stats, wait_for
from harness.processes import SHARED_LEASE_TTL, free_port, start_cache_service, start_model_service
from kv_replay import replay
from lora_adapters import hf_llama_of, write_adapter
from model_service.loading.tiny import tiny_config
from model_service.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from pagedkv.cache.v1 import cache_pb2
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata
from scrape import metric

pytest.importorskip("peft")
OPS, TEAM_A, TEAM_B, SINGLE = "sk-ops-tenant-key", "sk-team-a-key", "sk-team-b-key", "sk-single-token"
BASE = "tiny-base"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """--lora-load-dir with three adapters (alpha, beta, gamma), and one outside it."""
    root = tmp_path_factory.mktemp("lora")
    load_dir, outside = root / "loras", root / "outside"
    base = hf_llama_of(tiny_config())
    for seed, name in enumerate(("alpha", "beta", "gamma")):
        write_adapter(load_dir / name, base, rank=4, seed=seed, scale=0.5)
    write_adapter(outside / "secret", base, rank=4, seed=9)
    return load_dir, outside


@pytest.fixture(scope="module")
def replay_endpoint() -> str:
    """The cache service's KV events replay socket."""
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def stack(adapters, replay_endpoint, tmp_path_factory):
    load_dir, _ = adapters
    tmp = tmp_path_factory.mktemp("stack")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({OPS: {"tenant": "ops", "may_load_loras": True},
                                TEAM_A: {"tenant": "a", "loras": ["alpha"]},
                                TEAM_B: {"tenant": "b"}}))
    os.chmod(keys, 0o600)
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB",
                             "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
                             "--kv-events-replay-endpoint", replay_endpoint) as cache, \
            start_model_service(tmp, cache.address, "--served-model-name", BASE, "--dtype", "float32",
                                "--lora-load-dir", str(load_dir), "--max-loras", "2", "--max-num-seqs", "1",
                                "--api-keys", str(keys), "--auth-token", SINGLE) as model, \
            grpc.insecure_channel(model.address) as channel:
        yield cache, model, model_pb2_grpc.ModelServiceStub(channel)


@dataclass
class Answer:
    status_code: int
    text: str

    def json(self):
        return json.loads(self.text)


def post(model, path: str, key: str, body: dict) -> Answer:
    request = urllib.request.Request(f"{model.http_url.removesuffix('/v1')}{path}", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.read().decode())


def load(model, name: str, path, key: str = OPS) -> Answer:
    return post(model, "/v1/load_lora_adapter", key, {"lora_name": name, "lora_path": str(path)})


def unload(model, name: str, key: str = OPS) -> Answer:
    return post(model, "/v1/unload_lora_adapter", key, {"lora_name": name})


def models(model, key: str = OPS) -> set[str]:
    client = openai.OpenAI(base_url=model.http_url, api_key=key, max_retries=0)
    return {card.id for card in client.models.list().data}


def resident_bytes(model) -> float:
    return metric(model, "pagedkv_model_lora_adapter_bytes")


def nbytes(adapters, name: str) -> int:
    return load_adapter(name, adapters[0] / name, tiny_config(), max_rank=64).nbytes


@pytest.fixture
def clean(stack):
    """Every test starts and ends with no adapter loaded."""
    _, model, _ = stack
    yield
    for name in models(model) - {BASE}:
        unload(model, name)
    wait_for(lambda: resident_bytes(model) == 0, 30, "every adapter's bytes freed")


def test_load_use_unload_over_http(adapters, stack, clean):
    cache, model, stub = stack
    answer = load(model, "alpha", adapters[0] / "alpha")
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'alpha' added successfully."
    assert models(model) == {BASE, "alpha"}
    assert resident_bytes(model) == nbytes(adapters, "alpha")
    base_tokens, _ = grpc_generate.greedy(stub, PROMPT, 6, metadata=bearer_metadata(OPS))
    tokens, _ = grpc_generate.greedy(stub, PROMPT, 6, lora_name="alpha", metadata=bearer_metadata(OPS))
    assert tokens != base_tokens  # the adapter is applied
    client = openai.OpenAI(base_url=model.http_url, api_key=OPS, max_retries=0)
    completion = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.model == "alpha"
    assert metric(model, "pagedkv_model_lora_requests_total", adapter="alpha") == 2
    assert metric(model, "pagedkv_model_lora_generated_tokens_total", adapter="alpha") == 12

    answer = unload(model, "alpha")
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'alpha' removed successfully."
    assert models(model) == {BASE}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="alpha", prompt=PROMPT, max_tokens=1)
    scraped = urllib.request.urlopen(model.metrics_url, timeout=10).read().decode()
    assert 'adapter="alpha"' not in scraped  # the series went with the adapter
    assert resident_bytes(model) == 0
    # Loaded again under the same name, it gives the same tokens.
    assert load(model, "alpha", "alpha").status_code == 200  # relative to --lora-load-dir
    assert grpc_generate.greedy(stub, PROMPT, 6, lora_name="alpha", metadata=bearer_metadata(OPS))[0] == tokens
    no_block_leased(cache)


def test_grpc_twins(adapters, stack, clean):
    _, model, stub = stack
    reply = stub.LoadLoraAdapter(model_pb2.LoadLoraAdapterRequest(lora_name="beta", lora_path="beta"),
                                 metadata=bearer_metadata(SINGLE))
    assert reply.message == "Success: LoRA adapter 'beta' added successfully."
    assert models(model) == {BASE, "beta"}
    with pytest.raises(grpc.RpcError) as error:
        stub.LoadLoraAdapter(model_pb2.LoadLoraAdapterRequest(lora_name="beta", lora_path="gamma"),
                             metadata=bearer_metadata(SINGLE))
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already been loaded" in error.value.details()
    reply = stub.UnloadLoraAdapter(model_pb2.UnloadLoraAdapterRequest(lora_name="beta"),
                                   metadata=bearer_metadata(SINGLE))
    assert reply.message == "Success: LoRA adapter 'beta' removed successfully."
    with pytest.raises(grpc.RpcError) as error:
        stub.UnloadLoraAdapter(model_pb2.UnloadLoraAdapterRequest(lora_name="beta"), metadata=bearer_metadata(SINGLE))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "cannot be found" in error.value.details()
    for key, code in ((TEAM_B, grpc.StatusCode.PERMISSION_DENIED), (None, grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as error:
            stub.LoadLoraAdapter(model_pb2.LoadLoraAdapterRequest(lora_name="beta", lora_path="beta"),
                                 metadata=bearer_metadata(key))
        assert error.value.code() == code
    assert models(model) == {BASE}


def test_vllm_statuses_and_texts(adapters, stack, clean):
    _, model, _ = stack
    assert load(model, "alpha", "alpha").status_code == 200
    duplicate = load(model, "alpha", "beta")
    assert duplicate.status_code == 400
    assert "The lora adapter 'alpha' has already been loaded" in duplicate.json()["error"]["message"]
    missing = unload(model, "nobody")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'nobody' cannot be found."
    empty = post(model, "/v1/load_lora_adapter", OPS, {"lora_name": "x"})
    assert empty.status_code == 400
    assert empty.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    assert post(model, "/v1/load_lora_adapter", OPS, {"lora_name": "x", "lora_path": "beta", "extra": 1}
                ).status_code == 400
    assert load(model, BASE, "beta").status_code == 400  # the base model's name
    assert load(model, "bad name!", "beta").status_code == 400
    # Two slots: a third adapter is refused until one goes.
    assert load(model, "beta", "beta").status_code == 200
    full = load(model, "gamma", "gamma")
    assert full.status_code == 400 and "--max-loras 2" in full.json()["error"]["message"]
    assert unload(model, "beta").status_code == 200
    assert load(model, "gamma", "gamma").status_code == 200
    assert models(model) == {BASE, "alpha", "gamma"}


def test_tenant_rights_and_visibility(adapters, stack, clean):
    _, model, stub = stack
    refused = load(model, "alpha", "alpha", key=TEAM_B)
    assert refused.status_code == 403 and "may_load_loras" in refused.json()["error"]["message"]
    assert load(model, "alpha", "alpha").status_code == 200
    assert load(model, "beta", "beta").status_code == 200
    assert unload(model, "alpha", key=TEAM_B).status_code == 403
    # Tenant a may use alpha only: beta is an unknown model to it, everywhere.
    assert models(model, TEAM_A) == {BASE, "alpha"}
    assert models(model, TEAM_B) == {BASE, "alpha", "beta"}  # an entry without `loras`: every adapter
    client = openai.OpenAI(base_url=model.http_url, api_key=TEAM_A, max_retries=0)
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="beta", prompt=PROMPT, max_tokens=1)
    assert "'beta' does not exist" in str(error.value) and "'alpha'" in str(error.value)
    assert "beta'" not in str(error.value).split("does not exist", 1)[1]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("beta")
    with pytest.raises(grpc.RpcError) as failure:
        grpc_generate.greedy(stub, PROMPT, 1, lora_name="beta", metadata=bearer_metadata(TEAM_A))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND and "'alpha'" in failure.value.details()
    assert grpc_generate.greedy(stub, PROMPT, 1, lora_name="alpha", metadata=bearer_metadata(TEAM_A))[0]
    assert grpc_generate.greedy(stub, PROMPT, 1, lora_name="beta", metadata=bearer_metadata(TEAM_B))[0]


def test_concurrent_loads_of_one_name_load_it_once_while_generation_runs(adapters, stack, clean):
    _, model, stub = stack
    base_tokens, _ = grpc_generate.greedy(stub, PROMPT, 6, metadata=bearer_metadata(OPS))
    start = threading.Barrier(5)
    answers, generated = [], []

    def load_it(path: str) -> None:
        start.wait()
        answers.append(load(model, "alpha", path))

    def generate_base() -> None:
        start.wait()
        generated.append(grpc_generate.greedy(stub, PROMPT, 6, metadata=bearer_metadata(OPS))[0])

    threads = [threading.Thread(target=load_it, args=(path,)) for path in ("alpha", "alpha", "beta", "gamma")]
    threads.append(threading.Thread(target=generate_base))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(answer.status_code for answer in answers) == [200, 400, 400, 400]
    assert all("already been loaded" in answer.text for answer in answers if answer.status_code == 400)
    assert generated == [base_tokens]
    assert models(model) == {BASE, "alpha"}
    assert metric(model, "pagedkv_model_lora_adapters") == 1


def test_bad_paths_refused_and_nothing_kept(adapters, stack, clean, tmp_path):
    load_dir, outside = adapters
    _, model, _ = stack
    assert load(model, "alpha", "alpha").status_code == 200
    before = resident_bytes(model)
    link = load_dir / "link-out"
    if not link.exists():
        link.symlink_to(outside / "secret")
    huge_weights, huge_config = load_dir / "huge-weights", load_dir / "huge-config"
    for directory in (huge_weights, huge_config):
        if not directory.exists():
            directory.mkdir()
            for file in (CONFIG_FILE, WEIGHTS_FILE):
                (directory / file).write_bytes((load_dir / "beta" / file).read_bytes())
    with open(huge_weights / WEIGHTS_FILE, "r+b") as file:  # sparse: 8 GiB of tensors declared by size
        file.truncate(8 << 30)
    with open(huge_config / CONFIG_FILE, "r+b") as file:
        file.truncate(1 << 30)
    cases = {
        "../outside/secret": (400, "outside --lora-load-dir"),
        str(outside / "secret"): (400, "outside --lora-load-dir"),
        "link-out": (400, "outside --lora-load-dir"),
        "/etc": (400, "outside --lora-load-dir"),
        "nowhere": (404, "No adapter found"),
        "alpha/" + WEIGHTS_FILE: (404, "No adapter found"),  # a file, not a directory
        "a" * 5000: (400, "at most 4096 characters"),
        "huge-weights": (400, "more than an adapter"),
        "huge-config": (400, "more than a config holds"),
    }
    for path, (status, words) in cases.items():
        answer = load(model, "beta", path)
        assert answer.status_code == status, (path, answer.text)
        assert words in answer.json()["error"]["message"], (path, answer.text)
        assert "secret" not in answer.json()["error"]["message"].replace(path, "")
    assert post(model, "/v1/load_lora_adapter", OPS, {"lora_name": "beta", "lora_path": "be\u0000ta"}
                ).status_code == 400
    # Nothing of them kept: same adapters, same bytes, and both slots' worth still free.
    assert models(model) == {BASE, "alpha"} and resident_bytes(model) == before
    assert load(model, "beta", "beta").status_code == 200


@contextlib.contextmanager
def every_block_held(cache):
    """Leases every block of the pool to a session of the test's own, and gives them back at
    the end: meanwhile a new request of the model service waits for blocks (its allocation
    refused, asked again), admitted but not running, for as long as the test wants."""
    stub = cache_stub(cache.address)
    now = stats(stub)
    assert now.blocks_leased == 0, "the model service still holds blocks: it would serve from them"
    block_size = stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=10).block_size
    tokens = now.blocks_total * block_size
    session = attach(stub, "holds-every-block", max_model_len=tokens).session_id
    answer = lease(stub, session, allocate(tokens))
    held = answer.results[0]
    assert held.status == cache_pb2.LEASE_STATUS_OK and answer.blocks_available == 0, answer
    try:
        yield
    finally:
        lease(stub, session, release(held.sequence_id))
        stub.Detach(cache_pb2.DetachRequest(session_id=session), timeout=10)


def test_unload_under_a_waiting_request_waits_for_it(adapters, stack, clean):
    """A request with beta is admitted while the pool has no free block (the test holds them
    all), so it waits, holding beta; beta is unloaded meanwhile. Its slot and bytes stay
    held, so gamma does not fit the two slots, until the test gives the blocks back and the
    request has run with beta to its end."""
    cache, model, stub = stack
    assert load(model, "alpha", "alpha").status_code == 200
    assert load(model, "beta", "beta").status_code == 200
    both = nbytes(adapters, "alpha") + nbytes(adapters, "beta")
    assert resident_bytes(model) == both
    expected, _ = grpc_generate.greedy(stub, PROMPT, 8, lora_name="beta", metadata=bearer_metadata(OPS))
    no_block_leased(cache)  # the finished request's release has gone out
    results = {}

    def waiting() -> None:
        results["beta"] = grpc_generate.greedy(stub, PROMPT, 8, lora_name="beta", metadata=bearer_metadata(OPS))

    thread = threading.Thread(target=waiting)
    with every_block_held(cache):
        thread.start()
        wait_for(lambda: metric(model, "pagedkv_model_lora_requests_total", adapter="beta") == 2, 30,
                 "the waiting request accepted")
        assert unload(model, "beta").status_code == 200
        assert models(model) == {BASE, "alpha"}
        full = load(model, "gamma", "gamma")
        assert full.status_code == 400 and "still used by running requests" in full.json()["error"]["message"]
        assert resident_bytes(model) == both
        assert thread.is_alive() and "beta" not in results  # it cannot have run: no block was free
    thread.join(120)
    tokens, last = results["beta"]
    assert tokens == expected and last.finish_reason == model_pb2.FINISH_REASON_LENGTH
    wait_for(lambda: resident_bytes(model) == nbytes(adapters, "alpha"), 30, "beta's bytes freed")
    # No sequence holds blocks: no series (none lingers for beta, unloaded).
    wait_for(lambda: "pagedkv_model_lora_kv_blocks{" not in urllib.request.urlopen(model.metrics_url, timeout=10)
             .read().decode(), 30, "the block series gone")
    assert load(model, "gamma", "gamma").status_code == 200
    no_block_leased(cache)


def test_kv_events_carry_the_adapter_name(adapters, stack, replay_endpoint, clean):
    """BlockStored of blocks computed under an adapter says its name (vLLM's lora_name);
    the base's blocks say null."""
    cache, model, stub = stack
    assert load(model, "alpha", "alpha").status_code == 200
    adapted, base = list(range(20, 60)), list(range(60, 100))  # two full blocks of 16 each, and a part
    grpc_generate.greedy(stub, adapted, 1, lora_name="alpha", metadata=bearer_metadata(OPS))
    grpc_generate.greedy(stub, base, 1, metadata=bearer_metadata(OPS))

    def stored_by_first_token() -> dict[int, BlockStored]:
        events = [event for _, payload in replay(replay_endpoint, 0) for event in decode_batch(payload).events]
        return {event.token_ids[0]: event for event in events if isinstance(event, BlockStored)}

    stored = wait_for(lambda: (lambda got: got if {20, 60} <= set(got) else None)(stored_by_first_token()), 30,
                      "both prompts' blocks stored")
    assert stored[20].lora_name == "alpha" and stored[20].token_ids == adapted[:32]
    assert stored[60].lora_name is None and stored[60].token_ids == base[:32]
