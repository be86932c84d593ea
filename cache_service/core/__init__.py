"""The KV pool the servicer calls (pool.py): its sizing, the lease ledger and the sessions, in plain Python."""
