"""LoRA adapters served by real processes: the OpenAI `model` field and GenerateRequest.lora_name
pick the adapter, /v1/models lists them under the base, concurrent requests of three
adapters and the base give transformers + peft's greedy tokens (the adapter merged into a
float32 copy of the base), and each adapter's K/V is cached apart: another adapter never
hits it, the same adapter under another name does."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from grpc_generate import greedy
from harness.cache_helpers import no_block_leased
from harness.hf_checkpoints import write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from harness.reference_generate import prompt_ids, reference_greedy
from pagedkv.model.v1 import model_pb2_grpc
from lora_adapters import ALL_TARGETS, write_adapter

pytest.importorskip("peft")
MODEL = "llama-lora"
NEW_TOKENS = 8
TARGET_SETS = [ALL_TARGETS, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint, {name: adapter directory}, {name or None: merged reference})."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = write_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    directories, references = {}, {None: base}
    for index, targets in enumerate(TARGET_SETS):
        name = f"team{index}"
        directories[name] = write_adapter(tmp_path_factory.mktemp(name) / "adapter", copy.deepcopy(base),
                                          rank=8, alpha=16, targets=targets, seed=index, scale=0.3)
        references[name] = PeftModel.from_pretrained(copy.deepcopy(base), str(directories[name])).merge_and_unload()
    return checkpoint, directories, references


@pytest.fixture(scope="module")
def stack(setup, tmp_path_factory):
    checkpoint, directories, _ = setup
    modules = [arg for name, path in directories.items() for arg in ("--lora-modules", f"{name}={path}")]
    modules += ["--lora-modules", f"copy-of-team0={directories['team0']}"]
    tmp_path = tmp_path_factory.mktemp("stack")
    with start_cache_service(tmp_path, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(checkpoint), "--served-model-name", MODEL,
                                "--dtype", "float32", *modules) as model, \
            grpc.insecure_channel(model.address) as channel:
        yield cache, model, model_pb2_grpc.ModelServiceStub(channel)


@pytest.fixture(scope="module")
def client(stack):
    _, model, _ = stack
    return openai.OpenAI(base_url=model.http_url, api_key="unused", max_retries=0)


def test_models_lists_adapters_under_the_base(client):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL, "team0", "team1", "team2", "copy-of-team0"}
    assert cards[MODEL].parent is None
    assert all(cards[name].parent == MODEL for name in cards if name != MODEL)
    assert client.models.retrieve("team1").parent == MODEL


def test_mixed_adapters_and_base_match_transformers_peft(setup, stack):
    _, _, references = setup
    cache, _, stub = stack
    names = [None, "team0", "team1", "team2"]
    prompts = {name: prompt_ids(20 + 3 * i, seed=40 + i) for i, name in enumerate(names)}
    # Submitted together, so the engine batches them (and it must be right however it does).
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(greedy, stub, prompts[name], NEW_TOKENS, **({"lora_name": name} if name else {}))
                   for name in names}
        got = {name: future.result()[0] for name, future in futures.items()}
    for name in names:
        assert got[name] == reference_greedy(references[name], prompts[name], NEW_TOKENS), name
    assert len({tuple(tokens) for tokens in got.values()}) > 1  # the adapters change the output
    no_block_leased(cache)


def test_openai_model_field_picks_the_adapter(setup, client):
    _, _, references = setup
    prompt = prompt_ids(17, seed=7)
    answer = client.completions.create(model="team2", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
                                       logprobs=0)
    tokens = [int(token.removeprefix("token_id:")) for token in answer.choices[0].logprobs.tokens]
    assert answer.model == "team2"
    assert tokens == reference_greedy(references["team2"], prompt, NEW_TOKENS)


def test_unknown_model_is_404_and_unknown_lora_not_found(client, stack):
    _, _, stub = stack
    with pytest.raises(openai.NotFoundError, match="team9.*team0"):
        client.completions.create(model="team9", prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="x" * 100_000, prompt="hi", max_tokens=1)
    with pytest.raises(grpc.RpcError) as error:
        greedy(stub, [5, 6, 7], 1, lora_name="team9")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND and "team9" in error.value.details()


def test_each_adapter_caches_apart_and_a_copy_shares(stack):
    cache, _, stub = stack
    prompt = prompt_ids(70, seed=99)  # several whole blocks
    _, first = greedy(stub, prompt, 1, lora_name="team1")
    assert first.usage.cached_tokens == 0
    assert greedy(stub, prompt, 1, lora_name="team2")[1].usage.cached_tokens == 0
    assert greedy(stub, prompt, 1)[1].usage.cached_tokens == 0  # nor the base
    assert greedy(stub, prompt, 1, lora_name="team1")[1].usage.cached_tokens > 0
    # The same weights under another name are the same adapter: the same K/V.
    greedy(stub, prompt_ids(70, seed=98), 1, lora_name="team0")
    assert greedy(stub, prompt_ids(70, seed=98), 1, lora_name="copy-of-team0")[1].usage.cached_tokens > 0
    no_block_leased(cache)


def test_adapter_slots_are_in_the_pool_sizing(setup, stack):
    import torch

    from model_service.loading.loader import load_model
    from model_service.lora.peft_adapter import load_adapter, max_adapter_bytes

    checkpoint, directories, _ = setup
    _, model, _ = stack
    config = load_model(str(checkpoint), torch.float32, "cpu").config
    attached = next(event for event in model.log_events() if event.get("event") == "attached")
    # --max-loras 4 (the default) slots of rank 64 in float32; the four loaded adapters are resident.
    assert attached["lora_slot_bytes"] == 4 * max_adapter_bytes(config, 64, 4)
    resident = sum(load_adapter(name, path, config, max_rank=64).nbytes for name, path in directories.items())
    assert attached["lora_resident_bytes"] == resident + load_adapter("c", directories["team0"], config,
                                                                     max_rank=64).nbytes
