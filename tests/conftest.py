"""Settings the whole test process needs before anything imports grpc."""

import os

# The tests start service processes with a preexec_fn (PR_SET_PDEATHSIG), so Popen
# really forks; with gRPC's fork support on, its pre-fork handler waits for gRPC's own
# threads to quiesce, and a test hung there for minutes (seen in test_multi_tenant, the
# parent stuck in fork() inside cygrpc's atfork handler). The child only sets its death
# signal and execs, so it needs none of that support.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"


# Imported after the setting above: they import grpc.
import dataclasses  # noqa: E402

import pytest  # noqa: E402


@dataclasses.dataclass(frozen=True)
class SmolLM2Stack:
    stub: object  # a ModelServiceStub on one channel that lives as long as the stack
    cache: object  # the cache service's ServiceProcess
    model: object  # the model service's ServiceProcess


@pytest.fixture(scope="session")
def smollm2_stack(tmp_path_factory):
    """One SmolLM2-135M-Instruct stack for every test module that reads the real model.

    Starting one costs about a minute of the suite's two cores, so the modules share it;
    each test leaves no block leased, and what one test leaves in the prefix cache is an
    exact hit for another (the same K/V), never a different answer. The pool (64 MiB, about
    1,400 tokens at float32) has a host tier and a disk tier behind it, so a test that
    pushes blocks out of the pool reads them back from the tiers.
    """
    import grpc

    from pagedkv.model.v1 import model_pb2_grpc
    from processes import start_cache_service, start_model_service

    tmp_path = tmp_path_factory.mktemp("smollm2")
    with start_cache_service(tmp_path, "--kv-cache-bytes", "64MiB", "--host-cache-bytes", "32MiB",
                             "--disk-cache-dir", tmp_path / "disk-tier", "--disk-cache-bytes", "128MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", "smollm2", "--max-model-len", "512",
                                "--max-batch-prefill-tokens", "512", timeout_s=600) as model, \
            grpc.insecure_channel(model.address) as channel:
        yield SmolLM2Stack(model_pb2_grpc.ModelServiceStub(channel), cache, model)
