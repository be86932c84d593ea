"""The model service's side of the cache service: attach, heartbeat, batched leases.

The gRPC boundary of the engine: LeaseOps from the scheduler go out as one Lease call,
the answer comes back as a plain LeaseAnswer. lease() returns a future, so the engine
can run a forward pass while the call is on the wire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import structlog

from model_service.sched.lease_ops import (
    Allocated, Committed, Extended, Forked, LeaseAnswer, LeaseLost, LeaseOps, Refused, Released,
)
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.kv_geometry import KvGeometry
from pagedkv.serving import bearer_metadata, message_options

log = structlog.get_logger()

STATUS_PREFIX = "LEASE_STATUS_"

# gRPC's default reconnect backoff starts at 1 s and grows to 120 s, and while a channel
# waits out its backoff every call fails at once without trying to connect. After a
# cache service restart the engine's Attach retries would then keep failing for many
# seconds against a server that is already listening. Capping the backoff at 1 s makes
# re-attach follow the cache service's return within about a second.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# Attach's own deadline, longer than other calls' timeout_s: the first Attach builds the
# pool (maps or allocates all of it, and on CPU the shared-memory file), which can take
# longer than 10 s for a large pool. A deadline that passes anyway is retried with the
# same attach_key (attachment.attach), which gets back the session the cache service
# went on to open instead of opening a second one.
ATTACH_TIMEOUT_S = 120.0

# How long attaching waits for HoldSession's first message (an answer comes at once from
# a healthy cache service); past it the session lives on heartbeats until the hold is in.
HOLD_ANSWER_S = 10.0


class CacheClient:
    def __init__(self, address: str, *, auth_token: str | None = None, tls_ca: str | None = None,
                 max_message_bytes: int = 64 * 1024 * 1024, timeout_s: float = 10.0) -> None:
        self.address = address
        options = message_options(max_message_bytes) + RECONNECT_OPTIONS
        if tls_ca:
            credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = cache_pb2_grpc.CacheServiceStub(self.channel)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-sender")
        self.metadata = bearer_metadata(auth_token)
        self.timeout_s = timeout_s
        # The pool's blocks as the last Attach sized it: the kernels index the pool with
        # the block ids leases return, so none may point past it (0: not attached yet).
        self.num_blocks = 0

    def attach(self, client_name: str, geometry: KvGeometry, workspace_bytes: int,
               max_model_len: int, model_fingerprint: str = "",
               served_model_name: str = "", attach_key: str = "",
               weights_bytes_by_type: Mapping[str, int] | None = None, lora_slot_bytes: int = 0,
               lora_resident_bytes: int = 0) -> cache_pb2.AttachResponse:
        weights = dict(weights_bytes_by_type or {})
        request = cache_pb2.AttachRequest(
            client_name=client_name, geometry=geometry.to_proto(),
            workspace_bytes=workspace_bytes, max_model_len=max_model_len, model_fingerprint=model_fingerprint,
            served_model_name=served_model_name, attach_key=attach_key,
            weights_bytes=sum(weights.values()), weights_bytes_by_type=weights,
            lora_slot_bytes=lora_slot_bytes, lora_resident_bytes=lora_resident_bytes,
        )
        reply = self.stub.Attach(request, timeout=max(self.timeout_s, ATTACH_TIMEOUT_S), metadata=self.metadata)
        self.num_blocks = reply.sizing.num_blocks
        return reply

    def heartbeat(self, session_id: str, timeout_s: float | None = None) -> None:
        self.stub.Heartbeat(cache_pb2.HeartbeatRequest(session_id=session_id),
                            timeout=timeout_s or self.timeout_s, metadata=self.metadata)

    def hold(self, session_id: str):
        """HoldSession's stream, open with no deadline for the session's life; cancel() ends it."""
        return self.stub.HoldSession(cache_pb2.HoldSessionRequest(session_id=session_id), metadata=self.metadata)

    def detach(self, session_id: str) -> int:
        reply = self.stub.Detach(cache_pb2.DetachRequest(session_id=session_id),
                                 timeout=self.timeout_s, metadata=self.metadata)
        return reply.blocks_reclaimed

    def stats(self) -> cache_pb2.CacheStats:
        return self.stub.GetStats(cache_pb2.GetStatsRequest(), timeout=self.timeout_s, metadata=self.metadata)

    def reset_prefix_cache(self, session_id: str, all_models: bool = False) -> cache_pb2.ResetPrefixCacheResponse:
        return self.stub.ResetPrefixCache(cache_pb2.ResetPrefixCacheRequest(session_id=session_id, all_models=all_models),
                                          timeout=self.timeout_s, metadata=self.metadata)

    def lease(self, session_id: str, ops: LeaseOps) -> Future:
        """Sends ops as one Lease call; the future yields its LeaseAnswer.

        The call runs blocking on one long-lived sender thread: grpc's own .future() starts
        a polling thread whenever none is running, which between engine steps is nearly
        every call, and a thread start costs more than the call on loopback.
        """
        request = cache_pb2.LeaseRequest(session_id=session_id, ops=to_proto_ops(ops))
        return self._sender.submit(self._lease_blocking, request, ops)

    def _lease_blocking(self, request: cache_pb2.LeaseRequest, ops: LeaseOps) -> LeaseAnswer:
        reply = self.stub.Lease(request, timeout=self.timeout_s, metadata=self.metadata)
        answer = answer_from_proto(ops, request.ops, reply.results, reply.blocks_available)
        check_block_ids(answer, self.num_blocks)
        return answer

    def close(self) -> None:
        self._sender.shutdown(wait=False, cancel_futures=True)
        self.channel.close()


def check_block_ids(answer: LeaseAnswer, num_blocks: int) -> None:
    """LeaseLost (the engine re-attaches) when a block id is outside the pool: the C and
    Triton kernels would read and write past the pool's memory with it."""
    for outcome in answer.outcomes():
        ids = [*getattr(outcome, "block_ids", ()), *(getattr(outcome, "copy", None) or ())]
        bad = [block for block in ids if not 0 <= block < num_blocks]
        if bad:
            raise LeaseLost(f"the cache service leased block id {bad[0]}, outside its pool of {num_blocks} blocks "
                            f"(lease {getattr(outcome, 'lease_id', 0)}); the answer is not trusted: re-attaching")


def to_proto_ops(ops: LeaseOps) -> list[cache_pb2.LeaseOp]:
    proto_ops = [
        cache_pb2.LeaseOp(fork=cache_pb2.ForkOp(sequence_id=fork.parent_lease_id, num_tokens=fork.parent_tokens))
        for fork in ops.forks
    ]
    proto_ops.extend(
        cache_pb2.LeaseOp(release=cache_pb2.ReleaseOp(
            sequence_id=release.lease_id, cache_prefix=True, token_ids=release.cached_token_ids))
        for release in ops.releases
    )
    proto_ops.extend(
        cache_pb2.LeaseOp(truncate=cache_pb2.TruncateOp(sequence_id=seq.lease_id, num_tokens=tokens))
        for seq, tokens in ops.truncates
    )
    proto_ops.extend(
        cache_pb2.LeaseOp(extend=cache_pb2.ExtendOp(sequence_id=seq.lease_id, num_tokens=tokens))
        for seq, tokens in ops.extends
    )
    proto_ops.extend(
        cache_pb2.LeaseOp(commit=cache_pb2.CommitOp(sequence_id=seq.lease_id, token_ids=seq.token_ids[:tokens]))
        for seq, tokens in ops.commits
    )
    proto_ops.extend(
        cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(
            num_tokens=len(seq.token_ids), prompt_token_ids=seq.token_ids if seq.reuse_prefix else (),
            cache_salt=seq.cache_salt, lora_name=getattr(seq.lora, "name", "")))
        for seq in ops.allocations
    )
    proto_ops.extend(
        cache_pb2.LeaseOp(extend=cache_pb2.ExtendOp(sequence_id=seq.lease_id, num_tokens=tokens))
        for seq, tokens in ops.top_ups
    )
    return proto_ops


def answer_from_proto(ops: LeaseOps, sent, results, blocks_available: int) -> LeaseAnswer:
    """The LeaseResults answering `sent` (to_proto_ops(ops)) as a typed LeaseAnswer.

    LeaseLost when the results cannot be this call's: another count, or an extend,
    release or commit result naming another sequence than its op (the service names an
    op's sequence in its result, refused or not)."""
    if len(results) != len(sent):
        raise LeaseLost(f"the cache service answered {len(results)} ops of {len(sent)}")
    outcomes = []
    for op, result in zip(sent, results):
        kind = op.WhichOneof("op")
        if kind in ("extend", "release", "commit", "truncate") and result.sequence_id != getattr(op, kind).sequence_id:
            raise LeaseLost(f"the cache service answered the {kind} of lease {getattr(op, kind).sequence_id} "
                            f"about lease {result.sequence_id}: the answer is not this call's; re-attaching")
        outcomes.append(_DECODE[kind](result))
    return LeaseAnswer.of(ops, outcomes, blocks_available)


def _refused(result: cache_pb2.LeaseResult) -> Refused | None:
    if result.status == cache_pb2.LEASE_STATUS_OK:
        return None
    return Refused(cache_pb2.LeaseStatus.Name(result.status).removeprefix(STATUS_PREFIX), result.message)


def _forked(result: cache_pb2.LeaseResult) -> Forked | Refused:
    copy = (result.copy.src_block, result.copy.dst_block) if result.HasField("copy") else None
    return _refused(result) or Forked(result.sequence_id, tuple(result.block_ids), copy)


def _released(result: cache_pb2.LeaseResult) -> Released | Refused:
    return _refused(result) or Released()


def _extended(result: cache_pb2.LeaseResult) -> Extended | Refused:
    return _refused(result) or Extended(tuple(result.block_ids))


def _committed(result: cache_pb2.LeaseResult) -> Committed | Refused:
    return _refused(result) or Committed()


def _allocated(result: cache_pb2.LeaseResult) -> Allocated | Refused:
    return _refused(result) or Allocated(result.sequence_id, tuple(result.block_ids), result.cached_tokens,
                                         (result.cached_tokens_host, result.cached_tokens_disk,
                                          result.cached_tokens_remote))


_DECODE = {"fork": _forked, "release": _released, "truncate": _released, "extend": _extended, "commit": _committed,
           "allocate": _allocated}


class LeaseDeadline:
    """The engine's local view of when its session may expire at the cache service.

    The service expires a session TTL after the last call it received from it. A call
    the engine sent at time t and saw answered was received after t, so the session
    lives at least until t + TTL; past t + TTL - margin the engine must assume it may be
    gone (its blocks handed to another session) and stop writing K/V. The margin covers
    the forward pass that is already running when the deadline passes.
    """

    def __init__(self, ttl_s: float, acked_at: float, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.margin_s = ttl_s / 4
        self._clock = clock
        self._acked_at = acked_at
        self._lock = threading.Lock()

    def acked(self, sent_at: float) -> None:
        """A call sent at `sent_at` (this clock) was answered: the session lived then."""
        with self._lock:
            if sent_at > self._acked_at:
                self._acked_at = sent_at

    def remaining_s(self) -> float:
        return self._acked_at + self.ttl_s - self.margin_s - self._clock()

    def expired(self) -> bool:
        return self.remaining_s() <= 0


class Heartbeat:
    """Keeps a session alive from its own thread, so a long forward pass never lets it lapse.

    Each call's deadline is below the TTL: a call still unanswered after that says
    nothing the lease deadline does not already track, so it is abandoned and the next
    one sent on schedule, and the engine fences itself once no call got through for
    TTL - margin. Any other failure (NOT_FOUND: expired; UNAVAILABLE: gone) ends the session.

    A second thread holds the session (HoldSession) for as long as it lives: should this
    process die, its connection closes and the cache service takes the session's leases
    back without waiting for the TTL. The hold ending otherwise than by Detach ends the
    session here too, at once: the cache service expired it, is stopping, or is gone.
    """

    def __init__(self, client: CacheClient, session_id: str, interval_s: float, on_failure,
                 deadline: LeaseDeadline | None = None) -> None:
        self._client = client
        self._session_id = session_id
        self._interval_s = interval_s
        self._on_failure = on_failure
        self._deadline = deadline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-heartbeat", daemon=True)
        self._hold = None
        self._held = threading.Event()

    def start(self) -> Heartbeat:
        self._hold = self._client.hold(self._session_id)
        threading.Thread(target=self._keep_hold, name="cache-hold", daemon=True).start()
        # The session counts as held once the cache service said so (or refused): a process
        # killed right after attaching then has its leases reclaimed at once, too.
        self._held.wait(HOLD_ANSWER_S)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._hold is not None:
            self._hold.cancel()

    def _keep_hold(self) -> None:
        try:
            for _ in self._hold:
                self._held.set()
        except grpc.RpcError as error:
            self._held.set()
            if self._stop.is_set():
                return
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("session_hold_unsupported")  # an older cache service: the TTL alone finds a dead process
                return
            log.warning("session_hold_ended", code=error.code().name, details=error.details())
            self._on_failure(self._session_id, error)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            sent_at = time.monotonic()
            try:
                self._client.heartbeat(self._session_id, timeout_s=self._interval_s)
            except grpc.RpcError as error:
                if self._stop.is_set():
                    return
                log.warning("heartbeat_failed", code=error.code().name, details=error.details())
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._deadline is not None:
                    continue
                # The session id goes with the failure: by the time the engine reads it,
                # it may have re-attached, and this failure must not end the new session.
                self._on_failure(self._session_id, error)
                return
            if self._deadline is not None:
                self._deadline.acked(sent_at)
