"""Trust and resource boundaries through real services: per-session limits under a fork
storm, the cache credential kept apart from the clients' token, the metrics port's own
bind address, and a huge prompt refused without stalling other streams."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import grpc
import pytest

from harness.cache_helpers import allocate, attach, cache_stub, fork, lease, stats, wait_for
from harness.processes import start_cache_service, start_model_service
from pagedkv.cache.v1 import cache_pb2
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

pytestmark = pytest.mark.timeout(300)
POOL_ARGS = ("--kv-cache-bytes", str(64 * 8192), "--headroom", "0")  # 64 blocks of the tiny geometry


def test_a_fork_storm_fails_op_by_op_at_the_session_limit(tmp_path):
    with start_cache_service(tmp_path, *POOL_ARGS, "--max-session-sequences", "100",
                             "--max-session-blocks", "150") as service:
        stub = cache_stub(service.address)
        storm = attach(stub, "storm").session_id
        bystander = attach(stub, "bystander").session_id
        parent = lease(stub, storm, allocate(32)).results[0]  # two full blocks: forks need no free block
        assert parent.status == cache_pb2.LEASE_STATUS_OK
        # One call, 200 forks: the first 74 fit (2 + 74 * 2 = 150 table entries), every
        # other one fails alone and names the limit.
        results = lease(stub, storm, *[fork(parent.sequence_id) for _ in range(200)]).results
        ok = [r for r in results if r.status == cache_pb2.LEASE_STATUS_OK]
        refused = [r for r in results if r.status == cache_pb2.LEASE_STATUS_LIMIT_EXCEEDED]
        assert len(ok) == 74 and len(refused) == 126
        assert "--max-session-blocks" in refused[0].message and "150" in refused[0].message
        assert stats(stub).blocks_leased == 2
        # Forks of a one-block sequence reach the sequence limit first, in another session.
        small = attach(stub, "small-storm").session_id
        one_block = lease(stub, small, allocate(16)).results[0]
        results = lease(stub, small, *[fork(one_block.sequence_id) for _ in range(120)]).results
        assert [r.status for r in results].count(cache_pb2.LEASE_STATUS_OK) == 99
        assert results[-1].status == cache_pb2.LEASE_STATUS_LIMIT_EXCEEDED
        assert "--max-session-sequences" in results[-1].message
        # The bystander is untouched by the storms' limits.
        assert all(r.status == cache_pb2.LEASE_STATUS_OK
                   for r in lease(stub, bystander, *[allocate(16) for _ in range(10)]).results)
        assert stub.Detach(cache_pb2.DetachRequest(session_id=storm), timeout=10).blocks_reclaimed == 150
        assert stub.Detach(cache_pb2.DetachRequest(session_id=small), timeout=10).blocks_reclaimed == 100
        assert stats(stub).blocks_leased == 10 and stats(stub).sequences == 10


def test_the_model_service_never_sends_its_clients_token_to_the_cache_service(tmp_path):
    token = "one-token-for-everything"
    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB", "--auth-token", token) as cache:
        # Refused at Attach, after it listened: the start fails at once, with the log that says why
        # (not after the start's whole timeout).
        with pytest.raises(RuntimeError, match="exited with code 1") as refused:
            start_model_service(tmp_path, cache.address, "--auth-token", token)
        assert "UNAUTHENTICATED" in str(refused.value)
        with start_model_service(tmp_path, cache.address, "--auth-token", "clients-token",
                                 "--cache-auth-token", token) as model:
            stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
            request = model_pb2.GenerateRequest(prompt="hi", sampling=model_pb2.SamplingParams(max_new_tokens=2))
            responses = list(stub.Generate(request, timeout=60, metadata=(("authorization", "Bearer clients-token"),)))
            assert responses[-1].finish_reason
        with pytest.raises(grpc.RpcError) as error:
            attach(cache_stub(cache.address), metadata=(("authorization", "Bearer clients-token"),))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(IPv4 address, port) of every TCP socket the process listens on, from /proc (gRPC
    listens on an IPv6 socket with a v4-mapped address): a connection test would meet
    whichever other process (a parallel test's) listens on the same port at 127.0.0.1."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    listening = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                # the address's last four bytes (all of it in tcp), little-endian
                listening.add((socket.inet_ntoa(bytes.fromhex(address[-8:])[::-1]), int(port, 16)))
    return listening


def test_metrics_bind_their_own_host(tmp_path):
    with start_cache_service(tmp_path, "--host", "127.0.0.1", "--metrics-host", "127.0.0.2") as service:
        assert reachable("127.0.0.2", service.metrics_port)
        listening = listening_sockets(service.pid)
        assert ("127.0.0.2", service.metrics_port) in listening
        assert ("127.0.0.1", service.metrics_port) not in listening
        assert ("127.0.0.1", service.port) in listening


def test_a_huge_prompt_is_refused_by_size_while_other_streams_flow(tmp_path):
    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--max-message-bytes", str(20 * 2**20)) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address, options=[
            ("grpc.max_send_message_length", 20 * 2**20)]))
        background: list[int] = []
        finished = threading.Event()

        def stream():
            request = model_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=model_pb2.SamplingParams(
                max_new_tokens=400, temperature=0, ignore_eos=True))
            for response in stub.Generate(request, timeout=120):
                background.extend(response.token_ids)
            finished.set()

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: background, 60, "the background stream's first tokens")
        huge = model_pb2.GenerateRequest(prompt="x" * (16 * 2**20))  # 16 MB of text
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(huge, timeout=60))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bytes" in error.value.details() and "--max-prompt-tokens" in error.value.details()
        reader.join(120)
        assert finished.is_set() and len(background) == 400
        wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block back")
