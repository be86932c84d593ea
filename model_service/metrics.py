"""Prometheus metrics of the model service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Latency buckets from 1 ms to 30 s: CPU decode steps are tens of milliseconds, a
# queued request's first token can take seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REQUESTS = Counter("pagedkv_model_requests", "Finished Generate requests, by finish reason", ["finish_reason"])
REJECTED = Counter("pagedkv_model_requests_rejected", "Generate requests refused before queueing, by status", ["code"])
# The `tenant` label of requests that carry no tenant (no --api-keys, or --auth-token's key);
# --api-keys refuses a tenant of this name.
NO_TENANT = "none"


def tenant_label(tenant: str) -> str:
    return tenant or NO_TENANT


TENANT_REQUESTS = Counter("pagedkv_model_tenant_requests", "Generate requests accepted, by tenant (--api-keys; "
                          "none: no tenant)", ["tenant"])
TENANT_TOKENS = Counter("pagedkv_model_tenant_tokens", "Prompt and completion tokens of finished completions, "
                        "by tenant (--api-keys; none: no tenant)", ["tenant", "kind"])
TENANT_KV_BLOCKS = Gauge("pagedkv_model_tenant_kv_blocks", "KV blocks the tenant's sequences hold now, a block "
                         "shared among them counted once (--api-keys; none: no tenant)", ["tenant"])
TENANT_KV_BLOCKS_PEAK = Gauge("pagedkv_model_tenant_kv_blocks_peak", "The most KV blocks the tenant's sequences "
                              "held at once since the model service started", ["tenant"])
TENANT_PREEMPTIONS = Counter("pagedkv_model_tenant_preemptions", "The tenant's sequences preempted for recompute",
                             ["tenant"])
TENANT_BUDGET_DEFERRED_TOKENS = Counter(
    "pagedkv_model_tenant_budget_deferred_tokens", "Tokens the tenant's sequences would have run in a step but for its "
    "compute budget (--api-keys max_tokens_per_s), summed over steps: one held back three steps counts three",
    ["tenant"])
TENANT_BUDGET_DEFERRED_STEPS = Counter(
    "pagedkv_model_tenant_budget_deferred_steps", "Engine steps in which the tenant's compute budget "
    "(--api-keys max_tokens_per_s) held back some of its sequences' tokens", ["tenant"])
PROMPT_TOKENS = Counter("pagedkv_model_prompt_tokens", "Prompt tokens of accepted requests")
GENERATED_TOKENS = Counter("pagedkv_model_generated_tokens", "Tokens generated")
QUEUE_LENGTH = Gauge("pagedkv_model_queue_length", "Requests waiting for blocks or a batch slot")
RUNNING = Gauge("pagedkv_model_running_sequences", "Sequences holding blocks and being computed")
SPEC_PROPOSED = Counter("pagedkv_model_spec_proposed_tokens",
                        "Tokens proposed by speculative decoding (--speculative-method), by proposer", ["method"])
SPEC_ACCEPTED = Counter("pagedkv_model_spec_accepted_tokens",
                        "Proposed tokens that verification kept (the model chose them too), by proposer", ["method"])
PREEMPTIONS = Counter("pagedkv_model_preemptions", "Sequences preempted for recompute when the pool was full")
TIME_TO_FIRST_TOKEN_SECONDS = Histogram(
    "pagedkv_model_time_to_first_token_seconds", "From request arrival to its first token", buckets=LATENCY_BUCKETS
)
INTER_TOKEN_SECONDS = Histogram(
    "pagedkv_model_inter_token_seconds", "Between consecutive tokens of one request", buckets=LATENCY_BUCKETS
)
LEASE_WAIT_SECONDS = Counter(
    "pagedkv_model_lease_wait_seconds", "Engine time spent waiting on the cache service's lease replies"
)
LEASE_CALLS = Counter("pagedkv_model_lease_calls", "Lease calls sent to the cache service (at most one a step)")
LEASE_TOP_UPS = Counter(
    "pagedkv_model_lease_top_ups",
    "Extends asked ahead of need (--lease-ahead-blocks) in lease calls that went out anyway",
)
ENGINE_STEP_SECONDS = Counter(
    "pagedkv_model_engine_step_seconds", "Engine time spent in steps (forward passes, sampling and lease waits)"
)
CACHE_CONNECTED = Gauge("pagedkv_model_cache_connected", "1 while attached to the cache service")
GRAMMAR_COMPILES = Counter(
    "pagedkv_model_grammar_compiles",
    "Structured-output specs compiled by xgrammar (cache misses), by kind and result (ok, invalid, timeout)",
    ["kind", "result"],
)
GRAMMAR_CACHE_HITS = Counter(
    "pagedkv_model_grammar_cache_hits",
    "Structured-output requests whose spec was compiled already, or was being compiled for another, by kind",
    ["kind"],
)
GRAMMAR_CACHE_BYTES = Gauge(
    "pagedkv_model_grammar_cache_bytes",
    "Bytes of the compiled grammars kept for reuse (xgrammar's estimate plus the specs' text; "
    "bounded by --grammar-cache-bytes)",
)
GRAMMAR_COMPILES_STRAGGLING = Gauge(
    "pagedkv_model_grammar_compiles_straggling",
    "Grammar compiles past --grammar-compile-timeout-s still running (a thread cannot be stopped), at idle "
    "CPU priority; each holds one of --grammar-compile-threads until it ends",
)
GRAMMAR_COMPILES_ABANDONED = Counter(
    "pagedkv_model_grammar_compiles_abandoned",
    "Grammar compiles that ran past --grammar-compile-timeout-s and were moved to idle CPU priority (SCHED_IDLE)",
)
GRAMMAR_COMPILE_SECONDS = Histogram(
    "pagedkv_model_grammar_compile_seconds",
    "Time to compile one spec, refused ones included (the first compile also reads the vocabulary), by kind",
    ["kind"], buckets=LATENCY_BUCKETS,
)
DECODE_GRAPH_MEMORY_BYTES = Gauge(
    "pagedkv_model_decode_graph_memory_bytes",
    "Device memory the decode CUDA graphs reserve (one shared pool; part of the workspace reported at Attach)",
)
# Per LoRA adapter: a series exists only while its adapter is loaded (removed on unload), so
# the label's values are bounded by --max-loras.
LORA_REQUESTS = Counter("pagedkv_model_lora_requests", "Generate requests accepted, by the LoRA adapter they "
                        "run with (loaded adapters only)", ["adapter"])
LORA_GENERATED_TOKENS = Counter("pagedkv_model_lora_generated_tokens", "Completion tokens of finished "
                                "completions, by LoRA adapter (loaded adapters only)", ["adapter"])
LORA_ADAPTER_BYTES = Gauge("pagedkv_model_lora_adapter_bytes", "Bytes the LoRA adapters hold: those loaded and "
                           "those unloaded that running requests still use (out of the slots kept at Attach)")
LORA_ADAPTERS = Gauge("pagedkv_model_lora_adapters", "LoRA adapters loaded")
LORA_KV_BLOCKS = Gauge("pagedkv_model_lora_kv_blocks", "KV blocks the sequences of a LoRA adapter hold now, a "
                       "block shared among them counted once (a series only while they hold some)", ["adapter"])



def lora_changed(loaded: list[str], removed: list[str], adapters: int, resident_bytes: int) -> None:
    """The adapters' series after `loaded` came and `removed` went (model_service/lora/registry.py)."""
    for name in loaded:
        LORA_REQUESTS.labels(name)
        LORA_GENERATED_TOKENS.labels(name)
    for name in removed:
        _remove(LORA_REQUESTS, name)
        _remove(LORA_GENERATED_TOKENS, name)
    LORA_ADAPTERS.set(adapters)
    LORA_ADAPTER_BYTES.set(resident_bytes)


def lora_kv_blocks(held: dict[str, int]) -> None:
    """The block counts of the adapters whose count changed (the scheduler's); an adapter
    whose sequences hold none loses its series, so no unloaded adapter's lingers."""
    for name, blocks in held.items():
        if blocks:
            LORA_KV_BLOCKS.labels(name).set(blocks)
        else:
            _remove(LORA_KV_BLOCKS, name)


def _remove(metric, label: str) -> None:
    try:
        metric.remove(label)
    except KeyError:  # never set
        pass
