"""Prometheus metrics of the cache service.

Block counts are read from the ledger at scrape time (a collector, not gauges kept in
step by hand), so /metrics can never disagree with GetStats.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LEASE_OPS = Counter(
    "pagedkv_cache_lease_ops", "Lease operations applied, by kind and result", ["op", "status"]
)
LEASE_CALL_SECONDS = Histogram(
    "pagedkv_cache_lease_call_seconds",
    "Time to apply one batched Lease call inside the service",
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
)
SESSIONS_EXPIRED = Counter("pagedkv_cache_sessions_expired", "Sessions reaped after missing their lease TTL")


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


def register_pool(pool) -> None:
    REGISTRY.register(PoolCollector(pool))
