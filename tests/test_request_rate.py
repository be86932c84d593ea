"""request_rate.py's bucket of requests, on a clock the test moves: one second's worth (at
least one) to start, refilled at the rate, and a tenant without a rate never refused."""

from __future__ import annotations

import pytest

from model_service.api.request_rate import take_request
from model_service.api.tenants import Tenant
from fake_clock import Clock


def test_a_full_bucket_then_one_request_each_refill():
    tenant, clock = Tenant("e", max_requests_per_s=2), Clock()
    assert [take_request(tenant, clock) for _ in range(2)] == [0.0, 0.0]
    assert take_request(tenant, clock) == pytest.approx(0.5)  # empty: half a second to the next
    clock.now += 0.25
    assert take_request(tenant, clock) == pytest.approx(0.25)  # half a request in the bucket
    clock.now += 0.25
    assert take_request(tenant, clock) == 0.0
    clock.now += 60  # idle a minute: it holds one second's worth, no more
    assert [take_request(tenant, clock) == 0.0 for _ in range(3)] == [True, True, False]


def test_a_refused_request_takes_nothing_and_no_rate_is_no_limit():
    tenant, clock = Tenant("e", max_requests_per_s=1), Clock()
    assert take_request(tenant, clock) == 0.0
    for _ in range(5):  # refusals do not push the next allowed request further out
        assert take_request(tenant, clock) == pytest.approx(1.0)
    clock.now += 1.0
    assert take_request(tenant, clock) == 0.0
    unlimited = Tenant("b")
    assert all(take_request(unlimited, clock) == 0.0 for _ in range(1000))


def test_the_keys_file_takes_the_field_and_refuses_a_bad_one(tmp_path):
    from model_service.api.tenants import load_api_keys

    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-tenant-e-key": {"tenant": "e", "max_requests_per_s": 5}}')
    keys.chmod(0o600)
    assert load_api_keys(keys)["sk-tenant-e-key"].max_requests_per_s == 5
    keys.write_text('{"sk-tenant-e-key": {"tenant": "e", "max_requests_per_s": -1}}')
    with pytest.raises(ValueError, match="max_requests_per_s"):
        load_api_keys(keys)
