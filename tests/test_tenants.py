"""Tenants (--api-keys): the keys file, and what a tenant's key does to its requests at the
one Generate path both doors share. The file is parsed as the service parses it; the
requests go through GenerationService over a recording engine stand-in
(test_http_off_loop.py), which keeps the priority and cache salt each was submitted with.
The doors themselves, with real processes: test_tenants_served.py.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from test_http_off_loop import RecordingEngine

from model_service.api.generation import GenerateError, GenerationService
from model_service.api.tenants import SINGLE, ApiKeys, Tenant, load_api_keys
from pagedkv.model.v1 import model_pb2


def test_yaml_and_json_files_give_the_same_tenants(tmp_path):
    (tmp_path / "keys.yaml").write_text("sk-aaaaaaaa: {tenant: a, max_concurrent_requests: 2, min_priority: 5}\n"
                                        "sk-bbbbbbbb: {tenant: b}\nsk-cccccccc: {tenant: a, max_concurrent_requests: 2,"
                                        " min_priority: 5}\n")
    (tmp_path / "keys.json").write_text(json.dumps({
        "sk-aaaaaaaa": {"tenant": "a", "max_concurrent_requests": 2, "min_priority": 5},
        "sk-bbbbbbbb": {"tenant": "b"},
        "sk-cccccccc": {"tenant": "a", "max_concurrent_requests": 2, "min_priority": 5}}))
    from_yaml, from_json = load_api_keys(tmp_path / "keys.yaml"), load_api_keys(tmp_path / "keys.json")
    assert from_yaml == from_json
    assert from_yaml["sk-aaaaaaaa"] == Tenant("a", max_concurrent_requests=2, min_priority=5)
    assert from_yaml["sk-aaaaaaaa"] is from_yaml["sk-cccccccc"]  # one tenant, one count, whichever key
    keys = ApiKeys.configure("single-token", str(tmp_path / "keys.json"))
    assert keys.tenant_of(b"sk-bbbbbbbb").name == "b" and keys.tenant_of(b"single-token") is SINGLE
    assert keys.tenant_of(b"sk-unknown") is None and keys.tenant_of(b"") is None


def test_lora_fields_are_optional_and_read(tmp_path):
    (tmp_path / "keys.yaml").write_text("sk-aaaaaaaa: {tenant: a}\n"
                                        "sk-bbbbbbbb: {tenant: b, loras: [sql, chat], may_load_loras: true}\n"
                                        "sk-cccccccc: {tenant: c, loras: []}\n")
    keys = load_api_keys(tmp_path / "keys.yaml")
    old, listed, none = keys["sk-aaaaaaaa"], keys["sk-bbbbbbbb"], keys["sk-cccccccc"]
    assert old == Tenant("a") and old.may_use_lora("anything") and not old.may_load_loras  # as before
    assert listed.loras == {"sql", "chat"} and listed.may_load_loras
    assert listed.may_use_lora("sql") and not listed.may_use_lora("other")
    assert not none.may_use_lora("sql")
    assert SINGLE.may_load_loras and SINGLE.may_use_lora("sql")


@pytest.mark.parametrize(("content", "message"), [
    ('{"sk-aaaaaaaa": {"tenant": "a", "max_requests": 1}}', "unknown fields ['max_requests']"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "max_queued_requests": -1}}', "must be a non-negative integer"),
    ('{"sk-aaaaaaaa": {"max_queued_requests": 1}}', "tenant must be a name"),
    ('{"short": {"tenant": "a"}}', "8 characters or more"),
    ('{"sk-aaaaaaaa": {"tenant": "none"}}', "the metrics' label of requests without a tenant"),
    ('{"sk-aaaaaaaa": {"tenant": "a"}, "sk-bbbbbbbb": {"tenant": "a", "min_priority": 1}}', "different limits"),
    ("[1, 2]", "must map each key"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "loras": "sql"}}', "loras must list the names"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "loras": [1]}}', "loras must list the names"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "may_load_loras": "yes"}}', "may_load_loras must be true or false"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "max_tokens_per_s": -5}}', "max_tokens_per_s must be a non-negative integer"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "max_tokens_per_s": 1.5}}', "max_tokens_per_s must be a non-negative integer"),
    ('{"sk-aaaaaaaa": {"tenant": "a", "burst_tokens": 100}}', "burst_tokens is the most of a max_tokens_per_s"),
])
def test_a_broken_keys_file_is_refused_without_naming_a_key(tmp_path, content, message):
    (tmp_path / "keys.json").write_text(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        load_api_keys(tmp_path / "keys.json")
    assert "sk-" not in str(error.value)


def service() -> GenerationService:
    return GenerationService(RecordingEngine(), default_max_new_tokens=4, max_prompt_tokens=200)


def request(request_id: str, **fields) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], **fields)


def test_min_priority_clamps_and_the_cache_salt_defaults_to_the_tenant():
    generation, tenant = service(), Tenant("team-a", min_priority=5)
    for name, fields in (("eager", dict(priority=-10)), ("patient", dict(priority=9)),
                         ("salted", dict(cache_salt="shared"))):
        generation.start(request(name, **fields), tenant=tenant).close()
    generation.start(request("single", priority=-10)).close()
    how = generation.engine.how
    assert how["eager"]["priority"] == 5 and how["patient"]["priority"] == 9
    assert how["eager"]["cache_salt"] == "team-a" and how["salted"]["cache_salt"] == "shared"
    assert how["single"]["priority"] == -10 and how["single"]["cache_salt"] == ""


@pytest.mark.parametrize("limit", ["max_concurrent_requests", "max_queued_requests"])
def test_a_tenant_past_its_request_limit_is_resource_exhausted_others_are_not(limit):
    generation, tenant = service(), Tenant("team-a", **{limit: 2})
    held = [generation.start(request(f"a-{index}"), tenant=tenant) for index in range(2)]
    with pytest.raises(GenerateError) as error:
        asyncio.run(generation.start_async(request("a-2"), tenant=tenant))
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.value.retry_later
    assert "tenant 'team-a' has 2 requests" in error.value.message and f"its {limit} is 2" in error.value.message
    generation.start(request("b-0"), tenant=Tenant("team-b")).close()  # another tenant still runs
    held.pop().close()
    generation.start(request("a-3"), tenant=tenant).close()  # a slot freed, taken again
    held.pop().close()
    assert tenant.open_requests == 0 and tenant.queued_requests == 0


def test_a_reload_drops_revoked_keys_and_updates_a_tenant_in_place(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-aaaaaaaa": {"tenant": "a", "max_concurrent_requests": 2},
                                "sk-bbbbbbbb": {"tenant": "b"}}))
    path.chmod(0o600)
    keys = ApiKeys.configure("single-token", str(path))
    a = keys.tenant_of(b"sk-aaaaaaaa")
    a.open_requests = 1  # a request in flight, counted on this object
    path.write_text(json.dumps({"sk-aaaaaaaa": {"tenant": "a", "max_concurrent_requests": 5},
                                "sk-cccccccc": {"tenant": "c", "admin": True}}))
    assert keys.reload()
    assert keys.tenant_of(b"sk-aaaaaaaa") is a and a.max_concurrent_requests == 5 and a.open_requests == 1
    assert keys.tenant_of(b"sk-bbbbbbbb") is None and keys.tenant_of(b"sk-cccccccc").admin
    assert keys.tenant_of(b"single-token") is SINGLE and SINGLE.admin
    path.write_text("{not json")
    assert not keys.reload()  # a broken file changes nothing
    assert keys.tenant_of(b"sk-cccccccc") is not None


def test_compute_budgets_go_to_the_scheduler_and_a_reload_changes_them(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-aaaaaaaa": {"tenant": "a", "max_tokens_per_s": 500},
                                "sk-bbbbbbbb": {"tenant": "b", "max_tokens_per_s": 50, "burst_tokens": 200},
                                "sk-cccccccc": {"tenant": "c", "max_tokens_per_s": 0}}))
    path.chmod(0o600)
    keys = ApiKeys.configure(None, str(path))
    assert keys.compute_budgets() == (("a", 500, 0), ("b", 50, 200)), "0: no budget"
    assert keys.tenant_of(b"sk-aaaaaaaa") == Tenant("a", max_tokens_per_s=500)
    path.write_text(json.dumps({"sk-aaaaaaaa": {"tenant": "a", "max_tokens_per_s": 5, "max_concurrent_requests": 3},
                                "sk-bbbbbbbb": {"tenant": "b", "max_tokens_per_s": 50, "burst_tokens": 200}}))
    assert keys.reload()
    a = keys.tenant_of(b"sk-aaaaaaaa")
    assert a.max_concurrent_requests == 3 and a.max_tokens_per_s == 5
    assert keys.compute_budgets() == (("a", 5, 0), ("b", 50, 200)), "what server.py hands the engine"


def test_an_unknown_adapter_is_not_found_and_leaves_no_request_id_bound():
    import structlog

    generation = service()
    with pytest.raises(GenerateError) as error:
        generation.start(request("r1", lora_name="nobody"))
    assert error.value.code == grpc.StatusCode.NOT_FOUND and "'nobody'" in error.value.message
    assert "request_id" not in structlog.contextvars.get_contextvars()
