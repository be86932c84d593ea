"""The per-tenant KV block gauges: blocks each tenant holds now, and the most it ever held.

The scheduler counts a tenant's blocks (sched/tenant_blocks.py) and hands over the counts
that changed; this keeps the peaks, which outlive an attachment: a re-attach starts the
counts again, not the record of what a tenant once took.
"""

from __future__ import annotations

from model_service import metrics


class TenantBlockGauges:
    def __init__(self) -> None:
        self._peaks: dict[str, int] = {}

    def set(self, held: dict[str, int]) -> None:
        """Sets the gauges of the tenants whose count changed."""
        for tenant, blocks in held.items():
            label = metrics.tenant_label(tenant)
            metrics.TENANT_KV_BLOCKS.labels(label).set(blocks)
            if blocks > self._peaks.get(tenant, 0):
                self._peaks[tenant] = blocks
                metrics.TENANT_KV_BLOCKS_PEAK.labels(label).set(blocks)

    def zero(self) -> None:
        """Every tenant holds nothing now (the session that held their blocks is gone)."""
        self.set({tenant: 0 for tenant in self._peaks})
