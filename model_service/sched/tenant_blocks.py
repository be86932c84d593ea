"""What each tenant holds of the pool: its sequences' blocks, a block that several of them
share (the prompt blocks of n forked completions, a prefix found in the cache) counted
once, as the cache service counts it.

Tenants are names here (the empty name: requests of no tenant); the scheduler tells this
ledger each block a sequence gains (`hold`) and each table it gives back (`drop`), asks
it which tenants are past their share of the pool (`over_share`: --api-keys `kv_blocks`),
and the engine reads the counts that changed (`take_changed`) for its per-tenant metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class TenantBlocks:
    def __init__(self, shares: Mapping[str, int] | None = None) -> None:
        # Tenant -> its share of the pool, in blocks; a tenant without one has no limit.
        self.shares = {tenant: blocks for tenant, blocks in (shares or {}).items() if blocks > 0}
        self._refs: dict[str, dict[int, int]] = {}  # tenant -> block id -> its sequences holding it
        self._changed: set[str] = set()

    def over_share(self, tenant: str, more: int = 0) -> bool:
        """Whether the tenant holds more than its share, or would with `more` blocks."""
        share = self.shares.get(tenant)
        return share is not None and self.held(tenant) + more > share

    def held(self, tenant: str) -> int:
        """Distinct blocks the tenant's sequences hold now."""
        refs = self._refs.get(tenant)
        return len(refs) if refs else 0

    def hold(self, tenant: str, block_ids: Iterable[int]) -> None:
        refs = self._refs.setdefault(tenant, {})
        for block in block_ids:
            refs[block] = refs.get(block, 0) + 1
        self._changed.add(tenant)

    def drop(self, tenant: str, block_ids: Iterable[int]) -> None:
        refs = self._refs.get(tenant)
        if refs is None:
            return
        for block in block_ids:
            count = refs.get(block, 0) - 1
            if count > 0:
                refs[block] = count
            else:
                refs.pop(block, None)
        self._changed.add(tenant)

    def take_changed(self) -> dict[str, int]:
        """The tenants whose count changed since the last call, with their counts now."""
        changed, self._changed = self._changed, set()
        return {tenant: self.held(tenant) for tenant in changed}
