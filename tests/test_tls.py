"""TLS on both services: the cache service serves TLS, the model service serves TLS and
reaches the cache service over TLS (--cache-tls-ca), and plaintext gets nowhere.

The certificate is made at run time (self-signed, for 127.0.0.1 and localhost) with the
openssl command line.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import torch

from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from model_service.cache.client import CacheClient
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.health_probe import check
from pagedkv.kv_geometry import KvGeometry
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")


def make_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return cert, key


def wait_serving_tls(service, cert: Path, timeout_s: float = 120.0) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    deadline = time.monotonic() + timeout_s
    with grpc.secure_channel(service.address, credentials) as channel:
        while (answer := check(channel)) != "SERVING":
            assert service.returncode is None, f"exited: {service.logs()[-3000:]}"
            assert time.monotonic() < deadline, f"not SERVING over TLS after {timeout_s}s: {answer}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = make_certificate(tmp, "pagedkv-test")
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with start_cache_service(tmp, *tls, *SHARED_LEASE_TTL, "--kv-cache-bytes", "4MiB", wait_serving=False) as cache:
        wait_serving_tls(cache, cert)
        with start_model_service(tmp, cache.address, *tls, "--cache-tls-ca", str(cert), "--max-model-len", "256",
                                 wait_serving=False) as model:
            wait_serving_tls(model, cert)  # SERVING only once attached to the cache service, over TLS
            yield dict(cache=cache, model=model, cert=cert, tmp=tmp)


def test_generate_over_tls(tls_stack):
    credentials = grpc.ssl_channel_credentials(root_certificates=tls_stack["cert"].read_bytes())
    with grpc.secure_channel(tls_stack["model"].address, credentials) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        responses = list(stub.Generate(model_pb2.GenerateRequest(
            prompt="over TLS", sampling=model_pb2.SamplingParams(max_new_tokens=5, ignore_eos=True)), timeout=60))
    assert responses[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 5
    for service in ("cache", "model"):
        (event,) = [e for e in tls_stack[service].log_events() if e.get("event") == "grpc_listening"]
        assert event["tls"] is True


@pytest.mark.parametrize("service", ["cache", "model"])
def test_plaintext_client_gets_nowhere(tls_stack, service):
    with grpc.insecure_channel(tls_stack[service].address) as channel:
        assert check(channel, deadline_s=3.0).startswith("UNAVAILABLE")
        if service == "model":
            stub = model_pb2_grpc.ModelServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(model_pb2.GenerateRequest(prompt="hi"), timeout=5))
        else:
            with pytest.raises(grpc.RpcError) as error:
                cache_pb2_grpc.CacheServiceStub(channel).GetStats(cache_pb2.GetStatsRequest(), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", ["cache", "model"])
def test_client_that_does_not_trust_the_certificate_gets_nowhere(tls_stack, service):
    other_cert, _ = make_certificate(tls_stack["tmp"], "someone-else")
    credentials = grpc.ssl_channel_credentials(root_certificates=other_cert.read_bytes())
    with grpc.secure_channel(tls_stack[service].address, credentials) as channel:
        assert check(channel, deadline_s=3.0).startswith("UNAVAILABLE")


def test_cache_client_without_the_ca_cannot_attach(tls_stack):
    # A model service started without --cache-tls-ca never attaches to a TLS cache service.
    geometry = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    plaintext = CacheClient(tls_stack["cache"].address, timeout_s=3.0)
    try:
        with pytest.raises(grpc.RpcError) as error:
            plaintext.attach("no-tls", geometry, 0, 64)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        plaintext.close()


def test_openai_http_api_is_served_over_tls_too(tls_stack):
    import ssl

    import openai

    model = tls_stack["model"]
    trusted = ssl.create_default_context(cafile=str(tls_stack["cert"]))
    client = openai.OpenAI(base_url=f"https://127.0.0.1:{model.http_port}/v1", api_key="unused", max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=trusted))
    completion = client.completions.create(model="tiny", prompt="over TLS", max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    (event,) = [e for e in model.log_events() if e.get("event") == "http_listening"]
    assert event["tls"] is True
    plaintext = openai.OpenAI(base_url=f"http://127.0.0.1:{model.http_port}/v1", api_key="unused", max_retries=0,
                              timeout=10)
    with pytest.raises(openai.APIConnectionError):
        plaintext.models.list()
