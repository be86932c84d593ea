"""Prometheus metrics of the cache service.

Block counts are read from the ledger at scrape time (a collector, not gauges kept in
step by hand), so /metrics can never disagree with GetStats.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cache_service.core.stats import tier_stats

LEASE_OPS = Counter(
    "pagedkv_cache_lease_ops", "Lease operations applied, by kind and result", ["op", "status"]
)
LEASE_CALL_SECONDS = Histogram(
    "pagedkv_cache_lease_call_seconds",
    "Time to apply one batched Lease call inside the service",
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
)
SESSIONS_EXPIRED = Counter("pagedkv_cache_sessions_expired",
                           "Sessions reaped after missing their lease TTL or losing their HoldSession connection")


class PoolCollector:
    """Reads the live pool's counters when Prometheus scrapes."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def describe(self):
        return []

    def collect(self):
        pool = self._pool
        yield GaugeMetricFamily("pagedkv_cache_sessions", "Attached sessions", value=len(pool.sessions))
        if pool.ledger is None:
            return
        stats = pool.ledger.stats()
        blocks = GaugeMetricFamily("pagedkv_cache_blocks", "KV blocks by state", labels=["state"])
        blocks.add_metric(["total"], stats.blocks_total)
        blocks.add_metric(["free"], stats.blocks_free)
        blocks.add_metric(["leased"], stats.blocks_leased)
        blocks.add_metric(["cached"], stats.blocks_cached)
        yield blocks
        yield GaugeMetricFamily(
            "pagedkv_cache_usage_ratio", "Leased blocks over total blocks",
            value=stats.blocks_leased / stats.blocks_total if stats.blocks_total else 0.0,
        )
        yield GaugeMetricFamily("pagedkv_cache_sequences", "Sequences holding leases", value=stats.sequences)
        yield GaugeMetricFamily("pagedkv_cache_bytes_reserved", "Bytes of the pool allocation",
                                value=pool.sizing.pool_bytes)
        yield CounterMetricFamily("pagedkv_cache_prefix_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=stats.prefix_queries)
        yield CounterMetricFamily("pagedkv_cache_prefix_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=stats.prefix_hits)
        yield GaugeMetricFamily("pagedkv_cache_prefix_hit_rate", "Prefix hit tokens over queried tokens",
                                value=stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0)
        yield from tier_metrics(pool)


def tier_metrics(pool):
    """The KV tiers' blocks and traffic, labelled by tier (host, disk, remote), as GetStats's TierStats;
    and what only the remote tier counts."""
    rows = tier_stats(pool.tiers)
    if not rows:
        return
    blocks = GaugeMetricFamily("pagedkv_cache_tier_blocks", "KV tier blocks by state", labels=["tier", "state"])
    for row in rows:
        for state in ("total", "cached", "free", "queued"):
            blocks.add_metric([row["tier"], state], row[f"blocks_{state}"])
    yield blocks
    counters = (
        ("hit_tokens", "pagedkv_cache_tier_hit_tokens", "Prompt tokens allocations got from the tier"),
        ("demotions", "pagedkv_cache_tier_demotions", "Blocks copied into the tier"),
        ("promotions", "pagedkv_cache_tier_promotions", "Blocks copied out of the tier into the pool"),
        ("bytes_in", "pagedkv_cache_tier_bytes_in", "Bytes copied into the tier"),
        ("bytes_out", "pagedkv_cache_tier_bytes_out", "Bytes copied out of the tier into the pool"),
        ("seconds_in", "pagedkv_cache_tier_copy_in_seconds", "Seconds spent copying into the tier"),
        ("seconds_out", "pagedkv_cache_tier_copy_out_seconds", "Seconds spent copying out of the tier"),
        ("evictions", "pagedkv_cache_tier_evictions", "Blocks the tier dropped for room"),
        ("errors", "pagedkv_cache_tier_errors", "Failed tier writes and reads (skipped, never a failed request)"),
    )
    for key, name, help_text in counters:
        family = CounterMetricFamily(name, help_text, labels=["tier"])
        for row in rows:
            family.add_metric([row["tier"]], row[key])
        yield family
    used = GaugeMetricFamily("pagedkv_cache_tier_bytes_used", "Bytes the tier's blocks take", labels=["tier"])
    for row in rows:
        used.add_metric([row["tier"]], row["bytes_used"])
    yield used
    remote = pool.tiers.remote
    if remote is not None:
        outcomes = CounterMetricFamily("pagedkv_cache_remote_kv", "What befell the remote tier: blocks dropped or "
                                       "rejected, reads timed out, reconnections (never a failed request)",
                                       labels=["outcome"])
        for outcome, value in dataclasses.asdict(remote.remote).items():
            outcomes.add_metric([outcome], value)
        yield outcomes


def register_pool(pool) -> None:
    REGISTRY.register(PoolCollector(pool))
