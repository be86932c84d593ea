"""The cache service's network and disk surfaces under abuse: the KV event sockets, the
replay socket, and the disk tier's folder, files and key.

Real cache-service processes and real ZMQ and gRPC clients, except where a test must see
inside the process (which thread reads the disk; what a PUB socket queues for an idle
subscriber, whose volume a test could not push through Lease calls in seconds). Counts and
structure, never time: a bounded wait fails only on a stall of many seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import threading
import time

import grpc
import pytest
import torch
import zmq
import zmq.auth

from harness.cache_helpers import TINY_GEOMETRY, allocate, attach, cache_stub, lease, release, wait_for
from harness.processes import free_port, start_cache_service
from cache_service.events.publisher import KvEventPublisher
from cache_service.events.kv_events import BlockStored, decode_batch
from cache_service.tiers.disk_tier import DiskGeometry
from pagedkv.cache.v1 import cache_pb2
from pagedkv.token_bucket import TokenBucket
from scrape import metric

BS = 16  # the cache service's default --block-size
TAG = DiskGeometry(TINY_GEOMETRY["num_layers"], TINY_GEOMETRY["num_kv_heads"], TINY_GEOMETRY["head_dim"], BS,
                   torch.float32).tag



def replay_requests(service, outcome: str) -> float:
    return metric(service, "pagedkv_cache_kv_events_replay_requests_total", outcome=outcome)


def cache_prompts(stub, session: str, count: int, length: int = 2 * BS, first: int = 1000, salt: str = "") -> None:
    """Caches ``count`` distinct prompts: each Lease call is one event batch (or more)."""
    for index in range(count):
        prompt = [first + index * length + offset for offset in range(length)]
        op = cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(num_tokens=length, prompt_token_ids=prompt,
                                                             cache_salt=salt))
        [allocated] = lease(stub, session, op).results
        assert allocated.status == cache_pb2.LEASE_STATUS_OK, allocated.message
        lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=prompt))


def dealer(endpoint: str, **curve) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in curve.items():
        setattr(sock, option, value)
    sock.connect(endpoint)
    return sock


def read_replies(sock: zmq.Socket, answers: int) -> list[list[int]]:
    """The seqs of each of ``answers`` replies (each ends with seq -1), a bounded wait for each frame."""
    replies, current = [], []
    while len(replies) < answers:
        assert sock.poll(30_000), f"a replay answer did not come (got {len(replies)} of {answers})"
        _, topic, seq_bytes, payload = sock.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            replies.append(current)
            current = []
        else:
            current.append(seq)
    return replies


# ---------------------------------------------------------------- the replay socket


@contextlib.contextmanager
def replaying(tmp_path, prompts: int, *flags):
    """A cache service that publishes KV events and answers replay requests (``flags`` set
    its caps), with ``prompts`` prompts cached: AllBlocksCleared and a batch a prompt.
    Yields (service, stub, session, the replay endpoint)."""
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", "--kv-events-endpoint", pub,
                             "--kv-events-replay-endpoint", rep, *flags) as service:
        stub = cache_stub(service.address)
        session = attach(stub).session_id
        cache_prompts(stub, session, prompts)
        yield service, stub, session, rep


def test_replay_answers_at_most_its_cap_and_a_peer_past_its_rate_gets_nothing(tmp_path):
    # A rate this low refills one request in 100 s: the burst of one is all this test sees.
    with replaying(tmp_path, 10, "--kv-events-replay-max-batches", "5", "--kv-events-replay-rate", "0.01") as \
            (service, _, _, rep):
        sock = dealer(rep)
        for _ in range(20):
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
        wait_for(lambda: replay_requests(service, "answered") + replay_requests(service, "rate_limited") == 20,
                 30, "the replay thread to take the 20 requests")
        assert (replay_requests(service, "answered"), replay_requests(service, "rate_limited")) == (1, 19)
        assert read_replies(sock, 1) == [[0, 1, 2, 3, 4]]  # the oldest five of eleven, and nothing more
        assert not sock.poll(500), "a rate-limited request was answered"
        # Another peer address has its own budget; malformed requests cost nothing.
        other = dealer(rep.replace("tcp://", "tcp://127.0.0.2:0;"))
        other.send_multipart((b"", b"short"))
        other.send_multipart((b"", (5).to_bytes(8, "big")))
        assert read_replies(other, 1) == [[5, 6, 7, 8, 9]]
        assert replay_requests(service, "malformed") == 1
        sock.close()
        other.close()


def test_peers_from_many_addresses_share_one_batch_budget(tmp_path):
    """Each address has its own request budget, so a flood from many of them is bounded by
    the batches all of them get together: past the budget's burst (one whole answer here,
    the rate refilling one batch in 1000 s) the replay thread waits instead of sending."""
    with replaying(tmp_path, 10, "--kv-events-replay-max-batches", "5", "--kv-events-replay-rate", "1e9",
                   "--kv-events-replay-batches-per-s", "0.001") as (service, _, _, rep):
        socks = [dealer(rep.replace("tcp://", f"tcp://127.0.0.{2 + index}:0;")) for index in range(3)]
        for sock in socks:
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
        wait_for(lambda: metric(service, "pagedkv_cache_kv_events_replay_wait_seconds_total") > 0, 30,
                 "the replay thread to wait for its budget")
        assert replay_requests(service, "answered") == 1
        assert sum(sock.poll(0) > 0 for sock in socks) <= 1
        # Its replies went out whole; the waiting thread still lets the service stop.
        assert metric(service, "pagedkv_cache_kv_events_replay_batches_total") == 5
        for sock in socks:
            sock.close()


def test_the_batch_budget_refills_at_its_rate_up_to_its_burst():
    now = [100.0]
    budget = TokenBucket(rate=10.0, burst=20.0, clock=lambda: now[0])
    assert budget.take(15) == 0.0
    assert budget.take(10) == pytest.approx(0.5)  # 5 left: 5 more come in half a second
    now[0] += 0.5
    assert budget.take(10) == 0.0
    now[0] += 60.0  # a long idle banks no more than the burst
    assert budget.take(20) == 0.0 and budget.take(1) == pytest.approx(0.1)


def test_a_replay_flood_never_holds_up_a_lease(tmp_path):
    # No rate limit and a cap above the buffer: every request costs the replayer its whole
    # buffer, so a flood keeps it busy for far longer than a Lease call takes.
    with replaying(tmp_path, 60, "--kv-events-replay-rate", "1e9", "--kv-events-replay-max-batches", "10000") as \
            (service, stub, session, rep):
        flood = 10_000
        socks = [dealer(rep) for _ in range(8)]
        for index in range(flood):
            socks[index % len(socks)].send_multipart((b"", (0).to_bytes(8, "big")))
        wait_for(lambda: replay_requests(service, "answered") >= 1, 30, "the replay to start")
        # The Lease loop answers while the flood is served (a stall of many seconds fails the deadline).
        stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=20)
        cache_prompts(stub, session, 1, first=90_000)
        stub.Heartbeat(cache_pb2.HeartbeatRequest(session_id=session), timeout=20)
        answered = replay_requests(service, "answered")
        assert answered < flood, "the Lease calls waited until every replay request was answered"
        for sock in socks:
            sock.close()


# ---------------------------------------------------------------- the PUB socket


def test_an_idle_subscriber_gets_a_bounded_queue_and_the_rest_by_replay(tmp_path):
    from cache_service.events.settings import MAX_MESSAGE_BYTES, EventSettings

    budget = 4 * MAX_MESSAGE_BYTES
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                                 settings=EventSettings(subscriber_buffer_bytes=budget))
    try:
        idle = zmq.Context.instance().socket(zmq.SUB)
        idle.setsockopt(zmq.LINGER, 0)
        idle.setsockopt(zmq.RCVHWM, 1)
        idle.setsockopt(zmq.RCVBUF, 4096)
        idle.setsockopt(zmq.SUBSCRIBE, b"")
        idle.connect(publisher.endpoint)
        # Past ZMQ's slow joiner: publish until the subscription is in place.
        event = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(BS)), block_size=BS)
        wait_for(lambda: publisher.publish([event]) is not None and idle.poll(50), 30, "the subscription")
        idle.recv_multipart()
        # A run of many blocks: about 5 KiB of token ids a batch (ids past 2^16 take 5 bytes).
        tokens = [70_000 + index for index in range(BS * 64)]
        run = BlockStored(block_hashes=list(range(64)), parent_block_hash=None, token_ids=tokens, block_size=BS)
        first = publisher.publish([run])
        for _ in range(3000):
            last = publisher.publish([run])
        sent = sum(len(payload) for _, payload in publisher.buffer.since(first, 10**6))
        received, seqs = 0, []
        while idle.poll(1000):
            _, seq, payload = idle.recv_multipart()
            assert len(payload) <= MAX_MESSAGE_BYTES
            received += len(payload)
            seqs.append(int.from_bytes(seq, "big"))
        # What the service kept for this subscriber (and the kernel's socket buffers) came;
        # the rest was dropped, not queued.
        assert received < sent / 4, f"an idle subscriber was sent {received} of {sent} bytes"
        assert last not in seqs
        replayer = dealer(publisher.replay_endpoint)
        replayer.send_multipart((b"", last.to_bytes(8, "big")))
        assert read_replies(replayer, 1) == [[last]], "a dropped batch should be there to replay"
        replayer.close()
        idle.close()
    finally:
        publisher.close()


def test_a_large_batch_goes_out_as_messages_under_the_cap_with_its_chain_intact():
    from cache_service.events.settings import MAX_MESSAGE_BYTES
    from cache_service.events.kv_events import encode_batches

    tokens = list(range(70_000, 70_000 + BS * 500))
    event = BlockStored(block_hashes=list(range(100, 600)), parent_block_hash=7, token_ids=tokens, block_size=BS,
                        extra_keys=[["salt"]] + [None] * 499)
    payloads = encode_batches([event], 1.0, 0, MAX_MESSAGE_BYTES)
    assert len(payloads) > 1 and all(len(payload) <= MAX_MESSAGE_BYTES for payload in payloads)
    parts = [part for payload in payloads for part in decode_batch(payload).events]
    assert [hash_ for part in parts for hash_ in part.block_hashes] == event.block_hashes
    assert [token for part in parts for token in part.token_ids] == tokens
    assert [part.parent_block_hash for part in parts] == [7] + [part.block_hashes[-1] for part in parts[:-1]]
    assert [key for part in parts for key in part.extra_keys] == event.extra_keys


# ---------------------------------------------------------------- CURVE


def test_curve_lets_in_only_the_subscribers_whose_keys_it_was_given(tmp_path):
    keys, clients = tmp_path / "keys", tmp_path / "clients"
    keys.mkdir()
    clients.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    allowed_public, allowed_secret = zmq.auth.create_certificates(keys, "router")
    stranger_public, stranger_secret = zmq.auth.create_certificates(keys, "stranger")
    shutil.copy(allowed_public, clients)
    server_key, _ = zmq.auth.load_certificate(server_public)

    def curve_of(path) -> dict:
        public, secret = zmq.auth.load_certificate(path)
        return dict(curve_publickey=public, curve_secretkey=secret, curve_serverkey=server_key)

    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", "--kv-events-endpoint", pub,
                             "--kv-events-replay-endpoint", rep, "--kv-events-curve-secret-key", server_secret,
                             "--kv-events-curve-clients", clients) as service:
        subscribers = {}
        for name, curve in (("allowed", curve_of(allowed_secret)), ("stranger", curve_of(stranger_secret)),
                            ("plain", {})):
            sock = zmq.Context.instance().socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in curve.items():
                setattr(sock, option, value)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(pub)
            subscribers[name] = sock
        stub = cache_stub(service.address)
        session = attach(stub).session_id
        first = 5000
        deadline = time.monotonic() + 60  # a bound on a loaded machine: it ends at the first batch
        while not subscribers["allowed"].poll(200):
            assert time.monotonic() < deadline, "the allowed subscriber received nothing"
            cache_prompts(stub, session, 1, first=first)
            first += 100
        assert subscribers["allowed"].recv_multipart()[0] == b""
        cache_prompts(stub, session, 1, first=first)
        assert subscribers["allowed"].poll(30_000)
        for name in ("stranger", "plain"):
            assert not subscribers[name].poll(500), f"the {name} subscriber received KV events"
        # The replay socket is behind the same keys.
        allowed = dealer(rep, **curve_of(allowed_secret))
        allowed.send_multipart((b"", (0).to_bytes(8, "big")))
        assert read_replies(allowed, 1)[0][:1] == [0]
        for name, curve in (("stranger", curve_of(stranger_secret)), ("plain", {})):
            sock = dealer(rep, **curve)
            sock.send_multipart((b"", (0).to_bytes(8, "big")))
            assert not sock.poll(1000), f"the {name} client was answered by the replay socket"
            sock.close()
        allowed.close()
        for sock in subscribers.values():
            sock.close()
        assert replay_requests(service, "answered") == 1


# ---------------------------------------------------------------- the disk tier
#
# One service writes the module's blocks to disk and keeps running (it is the first holder
# of its folder); tests that restart from disk work on copies of its folder.

PROMPT = list(range(1000, 1000 + 3 * BS + 1))  # three full blocks and one token


def disk_service(tmp_path, folder, *extra):
    return start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", "--max-blocks", "8",
                               "--disk-cache-dir", folder, "--disk-cache-bytes", "4MiB", *extra)


@pytest.fixture(scope="module")
def disk_writer(tmp_path_factory):
    """A running service whose folder holds PROMPT's three blocks under cache salt "b" and
    under none (written behind, without a host tier): (service, folder)."""
    tmp = tmp_path_factory.mktemp("disk-writer")
    folder = tmp / "disk"
    with disk_service(tmp, folder) as service:
        stub = cache_stub(service.address)
        session = attach(stub).session_id
        for salt in ("b", ""):
            cache_prompts(stub, session, 1, length=len(PROMPT), salt=salt)
        wait_for(lambda: len(list((folder / TAG).glob("*.kvblock"))) == 6, 30, "the blocks on disk")
        yield service, folder


def copy_folder(disk_writer, tmp_path):
    """A copy of the writer's folder, modes and key included (not its lock: a copy is free)."""
    _, folder = disk_writer
    copy = tmp_path / "disk"
    shutil.copytree(folder, copy, symlinks=True)
    return copy


def cached_tokens(stub, session: str, prompt: list[int], salt: str = "b") -> int:
    op = cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(num_tokens=len(prompt), prompt_token_ids=prompt,
                                                         cache_salt=salt))
    [allocated] = lease(stub, session, op).results
    assert allocated.status == cache_pb2.LEASE_STATUS_OK, allocated.message
    lease(stub, session, release(allocated.sequence_id))
    return allocated.cached_tokens_disk


def chain_files(folder, prompt: list[int], salt: str = "b") -> list:
    """The block files of ``prompt``'s full blocks, in chain order."""
    from cache_service.tiers.disk_tier import SUFFIX
    from cache_service.tiers.tier_index import ROOT_PARENT, chain_digest

    paths, parent = [], ROOT_PARENT
    for index in range(len(prompt) // BS):
        parent = chain_digest(parent, ("", salt), tuple(prompt[index * BS : (index + 1) * BS]))
        paths.append(folder / TAG / (parent.hex() + SUFFIX))
    return paths


@pytest.fixture(scope="module")
def tampered(disk_writer, tmp_path_factory):
    """A service restarted on a copy of the writer's folder in which an attacker, as the same
    user with mode 0600 and every header field right, rewrote salt "b"'s three blocks with
    other K/V signed under a key of its own (it cannot read the service's), and another
    user made the third block of the unsalted chain writable by others (0666).
    Yields (service, stub, session, folder, the key before the restart)."""
    from cache_service.tiers.disk_folder import DiskFolder
    from cache_service.tiers.disk_tier import DiskTier

    tmp = tmp_path_factory.mktemp("tampered")
    folder = copy_folder(disk_writer, tmp)
    geometry = DiskGeometry(2, 2, 16, BS, torch.float32)
    service_folder = DiskFolder(folder)
    records = DiskTier(service_folder, 4 << 20, geometry).scan()
    service_folder.close()
    forger = DiskTier(DiskFolder(tmp / "forger"), 4 << 20, geometry)
    salted = {path.name for path in chain_files(folder, PROMPT, "b")}
    forged = [record for record in records if forger.path(record.digest).name in salted]
    assert len(records) == 6 and len(forged) == 3
    for record in forged:
        (folder / TAG / forger.path(record.digest).name).write_bytes(
            forger.encode(record, torch.full(forger.geometry.block_shape, 7.0)))
    os.chmod(chain_files(folder, PROMPT, "")[2], 0o666)  # the first two blocks still hit
    key = folder / ".hmac-key"
    made = key.read_bytes() if key.exists() else None
    with disk_service(tmp, folder) as service:
        stub = cache_stub(service.address)
        yield service, stub, attach(stub).session_id, folder, made


def test_block_files_not_signed_with_the_services_key_are_never_served(tampered):
    service, stub, session, _, _ = tampered
    assert cached_tokens(stub, session, PROMPT, "b") == 0, "a block signed with another key was served"
    assert "MAC mismatch" in service.logs()


def test_a_block_file_others_may_write_is_never_served_and_the_key_stays_private(disk_writer, tampered):
    _, written = disk_writer
    assert stat.S_IMODE(written.stat().st_mode) & 0o077 == 0
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in (written / TAG).glob("*.kvblock"))
    service, stub, session, folder, made = tampered
    assert cached_tokens(stub, session, PROMPT, "") == 2 * BS, "a world-writable block file was served"
    assert "writable by group or others" in service.logs()
    key = folder / ".hmac-key"
    assert made is not None and len(made) == 32 and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_bytes() == made, "a restart made a new key: every file on disk would be lost"


@pytest.mark.parametrize("problem", ["world-writable", "other owner", "symlink", "key readable by others"])
def test_a_disk_folder_or_key_others_could_change_is_refused(tmp_path, problem):
    from cache_service.tiers.disk_folder import DiskFolder, DiskFolderRefused

    folder = tmp_path / "disk"
    folder.mkdir(mode=0o700)
    if problem == "world-writable":
        os.chmod(folder, 0o777)
        message = "writable by group or others"
    elif problem == "other owner":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(folder, 4321, 4321)
        message = "owned by uid 4321"
    elif problem == "symlink":
        folder = tmp_path / "link"
        folder.symlink_to(tmp_path / "disk", target_is_directory=True)
        message = "symlink"
    else:
        key = folder / ".hmac-key"
        key.write_bytes(os.urandom(32))
        os.chmod(key, 0o644)
        message = "may be read by group or others"
    with pytest.raises(DiskFolderRefused, match=message):
        DiskFolder(folder)


def test_a_service_refuses_a_shared_disk_folder_at_start(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    with pytest.raises(RuntimeError, match="writable by group or others"):
        disk_service(tmp_path, folder)


def test_a_second_service_on_one_disk_folder_is_refused_naming_the_first(tmp_path, disk_writer):
    first, folder = disk_writer
    with pytest.raises(RuntimeError, match=f"in use by cache service pid {first.pid}"):
        disk_service(tmp_path, folder)
    attach(cache_stub(first.address))  # the first is untouched


def test_a_promotion_reads_the_disk_in_a_worker_thread_not_on_the_lease_loop(tmp_path, disk_writer, monkeypatch):
    from cache_service.core.pool import KvPool, PoolSettings
    from cache_service.api.servicer import CacheServicer
    from cache_service.tiers import disk_tier
    from cache_service.tiers.settings import TierSettings

    folder = copy_folder(disk_writer, tmp_path)
    readers: list[int] = []
    read = disk_tier.DiskTier.read

    def spy(self, record):
        readers.append(threading.get_ident())
        return read(self, record)

    monkeypatch.setattr(disk_tier.DiskTier, "read", spy)

    async def lease_on_a_loop() -> int:
        settings = PoolSettings(kv_cache_bytes=1 << 20, max_blocks=8, shm_dir=str(tmp_path),
                                tiers=TierSettings(disk_cache_dir=str(folder), disk_cache_bytes=4 << 20))
        pool = KvPool(settings)
        try:
            servicer = CacheServicer(pool)
            request = cache_pb2.AttachRequest(client_name="t", geometry=cache_pb2.Geometry(**TINY_GEOMETRY),
                                              max_model_len=64)
            session = (await servicer.Attach(request, None)).session_id
            reply = await servicer.Lease(cache_pb2.LeaseRequest(session_id=session, ops=[
                allocate(len(PROMPT), PROMPT)]), None)
            return reply.results[0].cached_tokens_disk
        finally:
            pool.close()

    assert asyncio.run(lease_on_a_loop()) == 3 * BS
    assert len(readers) == 3 and threading.get_ident() not in readers, "the Lease loop read a block file"


def test_a_symlinked_geometry_folder_is_refused_and_nothing_is_removed_through_it(tmp_path):
    folder, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    folder.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    victim = elsewhere / "precious.tmp"  # a scan removes *.tmp files: it must not reach this one
    victim.write_bytes(b"keep me")
    (folder / TAG).symlink_to(elsewhere, target_is_directory=True)
    with disk_service(tmp_path, folder) as service:
        stub = cache_stub(service.address)
        with pytest.raises(grpc.RpcError) as refused:
            attach(stub)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "symlink" in refused.value.details()
    assert victim.read_bytes() == b"keep me"
