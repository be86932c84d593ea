"""What GetStats and /metrics report, read from the sessions, the ledger and the tiers as plain records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cache_service.core.ledger import Ledger, LedgerStats
from cache_service.core.sessions import Session
from cache_service.tiers.kv_tiers import KvTiers


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One model fingerprint that has attached: its live sessions (and their served names)
    and what its sequences hold and asked of the prefix cache."""

    model_fingerprint: str
    served_model_names: list[str]
    sessions: int
    sequences: int
    blocks_leased: int
    prefix_queries: int
    prefix_hits: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    sessions: int
    ledger: LedgerStats | None = None  # None: nothing has attached, there is no pool yet
    bytes_reserved: int = 0
    tiers: list[dict] = field(default_factory=list)  # tier_stats's rows
    models: list[ModelStats] = field(default_factory=list)


def pool_stats(sessions: Iterable[Session], ledger: Ledger | None, bytes_reserved: int,
               tiers: KvTiers | None) -> PoolStats:
    sessions = list(sessions)
    if ledger is None:
        return PoolStats(sessions=len(sessions))
    return PoolStats(sessions=len(sessions), ledger=ledger.stats(), bytes_reserved=bytes_reserved,
                     tiers=tier_stats(tiers), models=model_stats(sessions, ledger))


def model_stats(sessions: Iterable[Session], ledger: Ledger) -> list[ModelStats]:
    """One row per model fingerprint with a live session or a sequence, by fingerprint."""
    names: dict[str, list[str]] = {}
    for session in sessions:
        names.setdefault(session.model_fingerprint, []).append(session.served_model_name)
    usage = ledger.sequences.model_usage()
    out = []
    for fingerprint in sorted(set(names) | set(usage)):
        served = names.get(fingerprint, [])
        model = usage.get(fingerprint)
        out.append(ModelStats(
            model_fingerprint=fingerprint, served_model_names=sorted({name for name in served if name}),
            sessions=len(served), sequences=model.sequences if model else 0,
            blocks_leased=model.blocks_leased if model else 0, prefix_queries=model.prefix_queries if model else 0,
            prefix_hits=model.prefix_hits if model else 0,
        ))
    return out


def tier_stats(tiers: KvTiers | None) -> list[dict]:
    """Each configured tier's TierStats fields (GetStats and /metrics read the same)."""
    if tiers is None:
        return []
    out = []
    for tier, configured in (("host", tiers.host is not None), ("disk", tiers.disk is not None),
                             ("remote", tiers.remote is not None)):
        if not configured:
            continue
        counters = tiers.counters[tier]
        total = tiers.blocks_total(tier)
        cached = tiers.index.count(tier) if tier != "remote" else 0  # the store's blocks are not indexed here
        out.append(dict(
            tier=tier, blocks_total=total, blocks_cached=cached, blocks_free=max(total - cached, 0),
            hit_tokens=counters.hit_tokens, demotions=counters.demotions, promotions=counters.promotions,
            bytes_in=counters.bytes_in, bytes_out=counters.bytes_out, seconds_in=counters.seconds_in,
            seconds_out=counters.seconds_out, evictions=counters.evictions, errors=counters.errors,
            bytes_used=tiers.disk.used_bytes if tier == "disk" else cached * tiers.bytes_per_block,
            blocks_queued=tiers.blocks_queued(tier),
        ))
    return out
