"""Tenants: who a bearer key belongs to and what that tenant may do, for both doors.

`--api-keys FILE` (YAML or JSON) maps each key to a tenant:

    sk-team-a: {tenant: team-a, max_concurrent_requests: 8, max_queued_requests: 4, min_priority: 0}
    sk-batch: {tenant: batch, max_tokens_per_s: 2000, burst_tokens: 4000, max_requests_per_s: 20}
    sk-team-b: {tenant: team-b}
    sk-ops: {tenant: ops, admin: true}
    sk-team-c: {tenant: team-c, loras: [sql, chat], may_load_loras: true}

Every field but `tenant` is optional (0 or absent: no limit). `--auth-token` stays the
single-tenant form: one key, no tenant, no limits, and an admin's. A tenant's requests are
counted against its limits (RESOURCE_EXHAUSTED, HTTP 429, past them), a priority it asks
below its `min_priority` becomes `min_priority` (lower runs first), its cached prefixes
live in a namespace of its own (cache_namespace: the tenant and the salt it sends, so no
salt reaches another tenant's), and its `kv_blocks` goes to the scheduler by its name
(kv_block_shares). `max_tokens_per_s` is its compute budget: the tokens the engine computes for
it (prompt tokens prefilled, tokens decoded) refill a bucket of `burst_tokens` (0 or absent:
one second's worth) at that rate, and its sequences past it are skipped in a step, not
preempted nor failed, until it refills (sched/tenant_budgets.py, compute_budgets); its
streams only get slower. `max_requests_per_s` bounds how many requests its keys make, each
refused past it (429 before the body is read; RESOURCE_EXHAUSTED) so that bodies a limit
would refuse anyway cannot keep the event loop busy parsing them (request_rate.py).
`admin` keys may also drop the prefix cache, which every tenant shares.
`loras` lists the LoRA adapters the tenant may use (absent: every one loaded): any other is
an unknown model to it (404 / NOT_FOUND, and left out of /v1/models), so adapter names do
not leak between tenants. `may_load_loras` lets its keys load and unload adapters at run
time (otherwise 403 / PERMISSION_DENIED).
Keys are looked up by their SHA-256, so no comparison runs over a key's own bytes.

The file holds secrets: one that others may read is loaded with a warning. SIGHUP reads it
again (server.py): a key taken out stops working at once, a tenant's changed limits apply
to its next request, its compute budget from the engine's next step (keeping what it has
used: TenantBudgets.update), and requests in flight keep the tenant they started with;
`kv_blocks` alone is read at start-up only.
"""

from __future__ import annotations

import hashlib
import json
import stat
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import structlog

from model_service.metrics import NO_TENANT
from pagedkv.token_bucket import TokenBucket

log = structlog.get_logger()

FIELDS = ("tenant", "max_concurrent_requests", "max_queued_requests", "min_priority", "kv_blocks",
          "max_tokens_per_s", "burst_tokens", "max_requests_per_s", "admin", "loras", "may_load_loras")
COUNTS = ("max_concurrent_requests", "max_queued_requests", "min_priority", "kv_blocks", "max_tokens_per_s",
          "burst_tokens", "max_requests_per_s")
# Given to the scheduler at start-up: a SIGHUP leaves it as it was (logged). The compute
# budgets (max_tokens_per_s, burst_tokens) do reload: server.py hands them to the engine.
START_UP_ONLY = ("kv_blocks",)


@dataclass(slots=True)
class Tenant:
    name: str
    max_concurrent_requests: int = 0  # open Generate requests (queued or running); 0: no limit
    max_queued_requests: int = 0  # of them, those not yet past their first token; 0: no limit
    min_priority: int | None = None  # the most urgent priority it may ask for (lower runs first)
    # Its share of the pool, in blocks (0: none): past it, its sequences are preempted
    # first and its waiting ones admitted after other tenants' (sched/scheduler.py).
    kv_blocks: int = 0
    # Its compute budget: tokens computed for it a second, and the most its bucket holds
    # (0: one second's worth); 0: no budget. Past it, its sequences wait (sched/tenant_budgets.py).
    max_tokens_per_s: int = 0
    burst_tokens: int = 0
    # Requests a second its keys may make (HTTP: every route but /health, refused before the
    # body is read; gRPC: Generate); 0: no limit (request_rate.py).
    max_requests_per_s: int = 0
    admin: bool = False  # may drop the prefix cache (POST /reset_prefix_cache), every tenant's
    loras: frozenset[str] | None = None  # the LoRA adapters it may use; None: every one
    may_load_loras: bool = False  # may load and unload LoRA adapters at run time
    # Counted on the event loop by GenerationService.
    open_requests: int = field(default=0, compare=False)
    queued_requests: int = field(default=0, compare=False)
    # Its max_requests_per_s bucket (request_rate.py), made at its first request.
    request_bucket: TokenBucket | None = field(default=None, compare=False)

    def may_use_lora(self, name: str) -> bool:
        return self.loras is None or name in self.loras


# The tenant of --auth-token's key (and of every request when no key is asked for): no
# name, no limits, an admin.
SINGLE = Tenant("", admin=True, may_load_loras=True)


class ApiKeys:
    """Bearer key -> Tenant."""

    def __init__(self, tenants_by_key: dict[str, Tenant], *, auth_token: str | None = None,
                 path: Path | None = None) -> None:
        self._auth_token = auth_token
        self.path = path  # the --api-keys file, read again by reload()
        self._use(tenants_by_key)

    def _use(self, tenants_by_key: dict[str, Tenant]) -> None:
        by_key = dict(tenants_by_key)
        if self._auth_token:
            by_key.setdefault(self._auth_token, SINGLE)
        # Swapped whole, on the event loop: a lookup sees the old keys or the new ones.
        self._by_digest = {_digest(key.encode()): tenant for key, tenant in by_key.items()}
        self.tenants = {tenant.name: tenant for tenant in by_key.values()}
        self.has_tenants = any(self.tenants)  # a named one: --auth-token's key has no name

    @classmethod
    def configure(cls, auth_token: str | None, api_keys_file: str | None) -> ApiKeys | None:
        """The keys both doors accept; None when neither flag is set (no auth)."""
        if not auth_token and not api_keys_file:
            return None
        path = Path(api_keys_file) if api_keys_file else None
        return cls(load_api_keys(path) if path else {}, auth_token=auth_token, path=path)

    def reload(self) -> bool:
        """Reads the --api-keys file again (SIGHUP). Keys taken out stop working; a tenant
        that stays keeps its Tenant object, its limits updated in place, so the requests it
        has in flight are still counted against it. A file that no longer loads changes
        nothing (logged). Returns whether the new keys are in use."""
        if self.path is None:
            return False
        try:
            loaded = load_api_keys(self.path)
        except ValueError as error:
            log.error("api_keys_not_reloaded", reason=str(error))
            return False
        for key, tenant in loaded.items():
            current = self.tenants.get(tenant.name)
            if current is not None and current is not SINGLE:
                if current.kv_blocks != tenant.kv_blocks:
                    log.warning("api_keys_kv_blocks_unchanged", tenant=tenant.name,
                                reason="the scheduler's kv_blocks shares are set at start-up; restart to change them")
                for limit in fields(Tenant):
                    if limit.compare and limit.name != "name" and limit.name not in START_UP_ONLY:
                        setattr(current, limit.name, getattr(tenant, limit.name))
                loaded[key] = current
        self._use(loaded)
        log.info("api_keys_reloaded", path=str(self.path), keys=len(loaded), tenants=len(self.tenants))
        return True

    def tenant_of(self, token: bytes) -> Tenant | None:
        return self._by_digest.get(_digest(token)) if token else None

    def kv_block_shares(self) -> tuple[tuple[str, int], ...]:
        """(tenant, kv_blocks) of each tenant given a share of the pool, for the scheduler."""
        return tuple(sorted((name, tenant.kv_blocks) for name, tenant in self.tenants.items() if tenant.kv_blocks))

    def compute_budgets(self) -> tuple[tuple[str, int, int], ...]:
        """(tenant, max_tokens_per_s, burst_tokens) of each tenant given a compute budget, for the scheduler."""
        return tuple(sorted((name, tenant.max_tokens_per_s, tenant.burst_tokens)
                            for name, tenant in self.tenants.items() if tenant.max_tokens_per_s))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def cache_namespace(tenant: Tenant, cache_salt: str) -> str:
    """The salt a request of `tenant` runs with when the service has tenants: its tenant and
    the salt it sent, so that no salt a tenant sends (not even another's name) reaches
    another tenant's cached prefixes; two tenants sending one salt share nothing. The
    salt is hashed to keep the namespace short (the cache service takes 256 characters);
    the name has no fixed length, the hash has, so `name:hash` cannot be read two ways."""
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{tenant.name}:{digest}"


def load_api_keys(path: Path) -> dict[str, Tenant]:
    """The file's key -> Tenant; ValueError naming the file and the entry for anything wrong."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as error:
        raise ValueError(f"--api-keys {path}: cannot read it ({error.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("api_keys_file_readable_by_others", path=str(path), mode=oct(stat.S_IMODE(mode)),
                    fix=f"chmod 600 {path}: it holds every tenant's key")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as error:  # json's and yaml's errors
        raise ValueError(f"--api-keys {path} does not parse: {error}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--api-keys {path} must map each key to {{tenant: NAME, ...}}; it holds no keys")
    tenants: dict[str, Tenant] = {}
    for index, (key, entry) in enumerate(data.items()):
        where = f"--api-keys {path}, entry {index + 1}"  # never the key itself: it is a secret
        if not isinstance(key, str) or len(key) < 8 or not key.isprintable() or " " in key:
            raise ValueError(f"{where}: a key must be printable text of 8 characters or more without spaces")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: the value must be a mapping with at least `tenant`")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; known: {', '.join(FIELDS)}")
        name = entry.get("tenant")
        if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
            raise ValueError(f"{where}: tenant must be a name of 1 to 64 printable characters")
        if name == NO_TENANT:
            raise ValueError(f"{where}: tenant {NO_TENANT!r} is the metrics' label of requests without a tenant; "
                             "give this one another name")
        if entry.get("burst_tokens") and not entry.get("max_tokens_per_s"):
            raise ValueError(f"{where}: burst_tokens is the most of a max_tokens_per_s budget; it needs one")
        admin, may_load_loras = (_flag(entry, flag, where) for flag in ("admin", "may_load_loras"))
        tenants[key] = Tenant(name, admin=admin, may_load_loras=may_load_loras, loras=_loras(entry, where),
                              **{name_: _count(entry, name_, where) for name_ in COUNTS
                                 if entry.get(name_) is not None})
    return _one_tenant_object_per_name(tenants, path)


def _flag(entry: dict[str, Any], name: str, where: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _loras(entry: dict[str, Any], where: str) -> frozenset[str] | None:
    value = entry.get("loras")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(name, str) and name for name in value):
        raise ValueError(f"{where}: loras must list the names of the LoRA adapters the tenant may use, "
                         f"got {value!r}")
    return frozenset(value)


def _count(entry: dict[str, Any], name: str, where: str) -> int:
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, int) or (name != "min_priority" and value < 0):
        raise ValueError(f"{where}: {name} must be a{'n' if name == 'min_priority' else ' non-negative'} integer, "
                         f"got {value!r}")
    return value


def _one_tenant_object_per_name(tenants: dict[str, Tenant], path: Path) -> dict[str, Tenant]:
    """Several keys of one tenant share its limits and counts: one Tenant for them all."""
    by_name: dict[str, Tenant] = {}
    for key, tenant in tenants.items():
        first = by_name.setdefault(tenant.name, tenant)
        if first != tenant:
            raise ValueError(f"--api-keys {path}: the keys of tenant {tenant.name!r} give it different limits")
        tenants[key] = first
    return tenants
