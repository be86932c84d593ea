"""What each tenant holds of the pool: its sequences' blocks, a block that several of them
share (the prompt blocks of n forked completions, a prefix found in the cache) counted
once, as the cache service counts it.

Tenants are names here (the empty name: requests of no tenant); the scheduler tells this
ledger each block a sequence gains (`hold`) and each table it gives back (`drop`), and
the engine reads the counts that changed (`take_changed`) for its per-tenant metrics.
"""

from __future__ import annotations

from collections.abc import Iterable


class TenantBlocks:
    def __init__(self) -> None:
        self._refs: dict[str, dict[int, int]] = {}  # tenant -> block id -> its sequences holding it
        self._changed: set[str] = set()

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
