"""What only the Mooncake Store backend shows: its URL's query, and writes that are upserts
(a put on a key the store holds replaces the value, where Mooncake's plain put refuses
it). The behaviour every backend shares, against a real mooncake_master, is in
tests/test_remote_kv_backends.py."""

from __future__ import annotations

import pytest
from remote_kv_stores import MOONCAKE_LOAD_ERROR, new_store, skip_without_mooncake

from cache_service.tiers.remote_backends import open_store, parse_remote_url
from cache_service.tiers.remote_store import RemoteKvRefused

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.mooncake
@skip_without_mooncake
def test_a_write_on_a_key_the_store_holds_replaces_its_value(tmp_path):
    with new_store("mooncake", tmp_path) as master:
        client = open_store(parse_remote_url(master.url), 10.0)
        try:
            client.put_many([("pagedkv:test:upsert", b"first")])
            client.put_many([("pagedkv:test:upsert", b"again")])
            assert client.get_many(["pagedkv:test:upsert"], 16) == [b"again"]
        finally:
            client.close()


@pytest.mark.parametrize(("url", "message"), [
    ("mooncake://127.0.0.1", "host and RPC port"),
    ("mooncake://127.0.0.1:50051/path", "no user, password, path"),
    ("mooncake://u:p@127.0.0.1:50051", "no user, password, path"),
    ("mooncake://127.0.0.1:50051?segment=-1", "segment is a number of bytes"),
    ("mooncake://127.0.0.1:50051?buffer=0", "buffer must be more than 0"),
    ("mooncake://127.0.0.1:50051?segment=1&segment=2", "each once"),
    ("mooncake://127.0.0.1:50051?color=red", "the query takes segment=BYTES"),
    ("mooncake://127.0.0.1:50051?host=", "host is the address"),
    ("mooncake://127.0.0.1:50051?%zz", "the query takes"),
])
def test_a_bad_mooncake_url_is_refused_saying_what_is_understood(url, message):
    with pytest.raises(RemoteKvRefused, match=message):
        parse_remote_url(url)


def test_a_good_mooncake_url_is_understood_where_the_library_loads():
    url = "mooncake://10.0.0.5:50051?segment=0&host=10.0.0.9"
    if MOONCAKE_LOAD_ERROR is not None:
        with pytest.raises(RemoteKvRefused, match="libibverbs"):
            parse_remote_url(url)
        return
    address = parse_remote_url(url)
    assert str(address) == "mooncake://10.0.0.5:50051"
    assert (address.options.segment_bytes, address.options.host) == (0, "10.0.0.9")
