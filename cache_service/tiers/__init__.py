"""KV tiers beyond the device pool: host memory and disk, under the pool's prefix-index rules."""
