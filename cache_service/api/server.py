"""`python -m cache_service`: the cache service process."""

from __future__ import annotations

import argparse
import asyncio
import re

import structlog

from cache_service.api import metrics
from cache_service.events.publisher import KvEventPublisher
from cache_service.events.settings import (DEFAULT_REPLAY_BATCHES_PER_S, DEFAULT_REPLAY_MAX_BATCHES,
                                             DEFAULT_REPLAY_REQUESTS_PER_S, EventSettings)
from cache_service.core.ledger import DEFAULT_MAX_SESSION_BLOCKS, DEFAULT_MAX_SESSION_SEQUENCES, SessionLimits
from cache_service.core.pool import MAX_BLOCK_SIZE, KvPool, PoolSettings, parse_block_size
from cache_service.api.servicer import CacheServicer
from cache_service.tiers.disk_folder import DiskFolder
from cache_service.tiers.remote_store import load_remote_key
from cache_service.tiers.settings import DEFAULT_REMOTE_KV_QUEUE_BLOCKS, DEFAULT_REMOTE_KV_TIMEOUT_MS, TierSettings
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.flags import add_flag, add_server_flags
from pagedkv.records import record_from
from pagedkv.serving import GrpcServer, ServerConfig, run_server_main, serve_until_signal
from pagedkv.units import parse_bytes

log = structlog.get_logger()

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cache_service",
        description="pagedkv cache service: owns the KV block pool, sizes it, and leases block tables. "
        "`python -m cache_service sizing --help` is the offline sizing calculator.",
    )
    add_server_flags(parser, port=50052, metrics_port=9402)
    add_flag(parser, "--block-size", default=16, type=parse_block_size,
             help=f"tokens per KV block, a power of two up to {MAX_BLOCK_SIZE}")
    add_flag(parser, "--memory-fraction", default=0.90, type=float,
             help="share of device memory (CUDA) or available RAM (CPU, without --kv-cache-bytes) pagedkv may use")
    add_flag(parser, "--headroom", default=0.05, type=float,
             help="share of the budget left unallocated for allocator slack and activations warmup did not see")
    add_flag(parser, "--kv-cache-bytes", default=None, type=parse_bytes,
             help="the pool budget, e.g. 256MiB; CUDA: a cap below what --memory-fraction leaves (default: "
                  "--memory-fraction of device memory, or of available RAM on CPU)")
    add_flag(parser, "--max-blocks", default=None, type=int, help="upper bound on the number of blocks")
    add_flag(parser, "--lease-ttl-ms", default=5000, type=int,
             help="a session silent this long has every lease reclaimed")
    add_flag(parser, "--reclaim-grace-ms", default=5000, type=int,
             help="an expired session's blocks stay leased this much longer, so a stalled model service "
                  "finishing a forward pass never writes into blocks someone else holds")
    add_flag(parser, "--max-session-sequences", default=DEFAULT_MAX_SESSION_SEQUENCES, type=int,
             help="sequences one session may hold at once; an allocate or fork past it fails with LIMIT_EXCEEDED")
    add_flag(parser, "--max-session-blocks", default=DEFAULT_MAX_SESSION_BLOCKS, type=int,
             help="block-table entries one session may hold at once (a fork's shared blocks count again); "
                  "an op past it fails with LIMIT_EXCEEDED")
    add_flag(parser, "--shm-dir", default="/dev/shm", help="CPU: where the pool's shared-memory file lives")
    add_flag(parser, "--kv-events-endpoint", default=None, repeat=True, type=parse_event_endpoint,
             help="publish vLLM-format KV events (BlockStored, BlockRemoved, AllBlocksCleared) on a ZMQ PUB socket "
                  "bound here, e.g. tcp://127.0.0.1:5557, for prefix-aware routers such as vllm-router's kv_aware policy; "
                  "MODEL=tcp://127.0.0.1:5559 publishes only the blocks of the model served under that name there "
                  "(repeat the flag: one endpoint per model, and one without MODEL= for every model's)")
    add_flag(parser, "--kv-events-replay-endpoint", default=None, repeat=True, type=parse_event_endpoint,
             help="also bind a ZMQ ROUTER socket here (e.g. tcp://127.0.0.1:5558) from which a subscriber replays missed "
                  "event batches from a seq on; MODEL=tcp://127.0.0.1:5560 replays that model's endpoint (repeatable)")
    add_flag(parser, "--kv-events-subscriber-buffer-bytes", default="8MiB",
             type=parse_bytes, help="what one KV events subscriber that reads slowly (or not at all) may have "
             "queued in the service; past it that subscriber loses batches (it can replay them)")
    add_flag(parser, "--kv-events-replay-buffer-bytes", default="32MiB", type=parse_bytes,
             help="the replay socket keeps the newest event batches whose payloads fit in this")
    add_flag(parser, "--kv-events-replay-max-batches", default=DEFAULT_REPLAY_MAX_BATCHES, type=int,
             help="event batches one replay request is answered with at most (the oldest first)")
    add_flag(parser, "--kv-events-replay-rate", default=DEFAULT_REPLAY_REQUESTS_PER_S, type=float,
             help="replay requests one peer address may make per second (and in one burst); the rest are dropped")
    add_flag(parser, "--kv-events-replay-batches-per-s", default=DEFAULT_REPLAY_BATCHES_PER_S, type=float,
             help="event batches the replay socket sends per second, every peer together (bursts of one whole "
                  "answer); past it the replay thread waits and unread requests queue in the socket, so peers "
                  "from many addresses cannot take more of the service's CPU than this")
    add_flag(parser, "--kv-events-curve-secret-key", default=None,
             help="CURVE for the KV event sockets: the service's secret key file (zmq.auth's format, "
                  "NAME.key_secret); subscribers need its public key (default: plain TCP, no encryption)")
    add_flag(parser, "--kv-events-curve-clients", default=None,
             help="with --kv-events-curve-secret-key: a folder of the public key files (zmq.auth's format) of the "
                  "subscribers allowed to connect (default: any client that knows the service's public key)")
    add_flag(parser, "--host-cache-bytes", default=0, type=parse_bytes,
             help="host-memory KV tier beyond the pool, e.g. 8GiB: evicted prefix blocks are kept there and copied "
                  "back on a hit (0: off; CUDA: pinned memory; CPU: memory apart from the pool's budget)")
    add_flag(parser, "--disk-cache-dir", default=None,
             help="disk KV tier: blocks pushed out of the host tier (or the pool, without one) are written here, "
                  "one 0600 file a block, and found again after a restart of the cache service (same KV geometry)")
    add_flag(parser, "--disk-cache-bytes", default=0, type=parse_bytes,
             help="how much of --disk-cache-dir the disk tier may fill, e.g. 100GiB")
    add_flag(parser, "--disk-cache-key-file", default=None,
             help="the disk tier's HMAC key, which authenticates every block file: made (32 random bytes, 0600) at "
                  "the first start, refused if another user owns it or anyone else may read it "
                  "(default: .hmac-key in --disk-cache-dir)")
    add_flag(parser, "--remote-kv", default=None,
             help="a KV tier shared by every replica's cache service, on a Valkey (or Redis up to 7.2) server, "
                  "valkey://HOST:PORT[/DB] or redis://HOST:PORT[/DB], or a Mooncake Store master, "
                  "mooncake://HOST:PORT[?segment=BYTES&buffer=BYTES&host=ADDRESS] (docs/tiers.md); released prefix blocks are written to it in "
                  "the background, and a prompt's blocks no local tier holds are read from it (default: none)")
    add_flag(parser, "--remote-kv-key-file", default=None,
             help="with --remote-kv: the MAC key (32 bytes, mode 0600) every cache service of the cluster shares; "
                  "a block read from the store is used only if its MAC checks under it")
    add_flag(parser, "--remote-kv-timeout-ms", default=DEFAULT_REMOTE_KV_TIMEOUT_MS, type=int,
             help="how long a Lease call waits for the remote tier's blocks before it goes on without them "
                  "(those prompt tokens are recomputed), plus the time the read's bytes take at 256 MiB/s; "
                  "a store that slow is asked nothing for a while")
    add_flag(parser, "--remote-kv-queue-blocks", default=DEFAULT_REMOTE_KV_QUEUE_BLOCKS, type=int,
             help="blocks waiting to be written to the remote tier at most; past it, released blocks are not "
                  "written (counted in pagedkv_cache_remote_kv_total{outcome=\"dropped_queue_full\"})")
    add_flag(parser, "--check-invariants", action="store_true",
             help="check the ledger's, the pool's and the tiers' invariants after every call and background step, "
                  "logging invariant_broken when one fails (for tests and soak runs: each check walks the whole pool)")
    add_flag(parser, "--grace-s", default=5.0, type=float, help="seconds in-flight calls get on SIGTERM")
    return parser


async def reap_forever(pool: KvPool) -> None:
    # Four checks per TTL: a dead session's blocks come back within 1.25 TTL plus the
    # reclaim grace.
    interval = pool.settings.lease_ttl_ms / 4000
    while True:
        await asyncio.sleep(interval)
        metrics.SESSIONS_EXPIRED.inc(pool.reclaims.expire_sessions())
        await pool.reclaims.reclaim_expired()


def pool_settings(args: argparse.Namespace) -> PoolSettings:
    """The pool's settings from the command line (one place, so tests read what serve uses)."""
    limits = SessionLimits(max_sequences=args.max_session_sequences, max_blocks=args.max_session_blocks)
    return record_from(PoolSettings, args, session_limits=limits, tiers=record_from(TierSettings, args))


async def serve(args: argparse.Namespace) -> None:
    settings = pool_settings(args)
    # Checked and locked before anything binds: a second service on the folder stops here.
    tiers = settings.tiers
    remote_key = load_remote_key(tiers.remote_kv_key_file) if tiers.remote_kv else None
    disk_folder = DiskFolder(tiers.disk_cache_dir, tiers.disk_cache_key_file) if tiers.disk_cache_dir else None
    try:
        kv_events = kv_event_publishers(args)
    except BaseException:
        if disk_folder is not None:
            disk_folder.close()
        raise
    removed = pool_memory.cleanup_stale_pools(args.shm_dir)
    if removed:
        log.warning("stale_pools_removed", files=removed)
    pool = KvPool(settings, kv_events=kv_events, disk_folder=disk_folder, remote_key=remote_key)
    metrics.register_pool(pool)
    servicer = CacheServicer(pool)
    server = GrpcServer(
        ServerConfig.from_args(args),
        [SERVICE_NAME],
        lambda grpc_server: cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, grpc_server),
    )
    servicer.stopping = server.stopping
    tasks = []
    try:
        await server.start()
        tasks.append(asyncio.create_task(reap_forever(pool)))
        await server.set_serving(True)
        await serve_until_signal(server, grace_s=args.grace_s)
    finally:
        for task in tasks:
            task.cancel()
        pool.close()
        for publisher in kv_events:
            publisher.close()
        if disk_folder is not None:
            disk_folder.close()


# [MODEL=]ENDPOINT: the model is what comes before the "=" that precedes the endpoint's scheme.
_MODEL_ENDPOINT = re.compile(r"(?:(?P<model>.+?)=)?(?P<endpoint>[A-Za-z][A-Za-z0-9+.-]*://.+)", re.S)


def parse_event_endpoint(raw: str) -> tuple[str | None, str]:
    """A --kv-events-(replay-)endpoint value: (served model name or None for every model, ZMQ endpoint)."""
    match = _MODEL_ENDPOINT.fullmatch(raw)
    if match is None:
        return None, raw  # not an endpoint: binding it fails with a message that says so
    return match["model"], match["endpoint"]


def _by_model(values: list[tuple[str | None, str]] | None, flag: str) -> dict[str | None, str]:
    out: dict[str | None, str] = {}
    for model, endpoint in values or ():
        if model in out:
            raise ValueError(f"{flag} is given twice for {_whose(model)} ({out[model]} and {endpoint}); "
                             "one endpoint each")
        out[model] = endpoint
    return out


def _whose(model: str | None) -> str:
    return "every model" if model is None else f"model {model!r}"


def kv_event_publishers(args: argparse.Namespace) -> list[KvEventPublisher]:
    """One publisher per --kv-events-endpoint, each with its replay socket if one was given."""
    endpoints = _by_model(args.kv_events_endpoint, "--kv-events-endpoint")
    replays = _by_model(args.kv_events_replay_endpoint, "--kv-events-replay-endpoint")
    for model in replays:
        if model not in endpoints:
            prefix = "" if model is None else f"{model}="
            raise ValueError(f"--kv-events-replay-endpoint {prefix}{replays[model]} needs --kv-events-endpoint "
                             f"{prefix}...: it replays what that publishes")
    settings = event_settings(args)
    publishers: list[KvEventPublisher] = []
    try:
        for model, endpoint in endpoints.items():
            publishers.append(KvEventPublisher(endpoint, replays.get(model), settings=settings, model=model))
    except ValueError:
        for publisher in publishers:
            publisher.close()
        raise
    for publisher in publishers:
        log.info("kv_events_publishing", model=publisher.model, endpoint=publisher.endpoint,
                 replay_endpoint=publisher.replay_endpoint, curve=publisher.public_key is not None,
                 curve_clients=settings.curve_clients)
    return publishers


def event_settings(args: argparse.Namespace) -> EventSettings:
    # Each field is its --kv-events-* flag, but for the replay rate's shorter name.
    return record_from(EventSettings, args, prefix="kv_events_", replay_requests_per_s=args.kv_events_replay_rate)


def main(argv: list[str]) -> int:
    return run_server_main(build_parser(), argv, serve)
