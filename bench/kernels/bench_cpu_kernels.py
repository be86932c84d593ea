"""The CPU C kernels (model_service/cpu_kernels) against the torch code they replace, in
turns in one process: each op at a model's shapes (and greedy sampling's argmax over a
decode batch's logits), then whole engine steps (decode at
batch 1 and 48, one prefill) with the kernels on and off.

    .venv/bin/python -m bench.kernels.bench_cpu_kernels [--model smollm2|w48|PATH] [--dtype bfloat16|float32]
        [--threads 2] [--rounds 5] [--attention-only]

Decode attention runs at each level of the C kernel this CPU runs (portable, avx2, avx512),
over a pool of --dtype and an 8-bit one.

Ops are timed over many calls a round; steps over a few runner.execute calls. Medians of
rounds; the ratio is torch time / C time (above 1: C is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.serve.bench_generate import write_w48_checkpoint
from harness.peers.vllm_offline import smollm2_checkpoint

from model_service import cpu_kernels
from model_service.attention.torch_paged import decode_attention_torch
from model_service.cpu_kernels import argmax as cpu_argmax
from model_service.cpu_kernels import layer_ops, paged_decode
from model_service.models import fused_ops
from model_service.loading.loader import load_model
from model_service.models.rope import apply_rotary
from model_service.worker.runner import ModelRunner
from model_service.sched.sequence import Sequence

BLOCK_SIZE = 16


def per_call(fn, calls: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def in_turns(pairs: dict[str, tuple], rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """name: (torch fn, C fn) -> name: (median torch seconds, median C seconds), taking turns."""
    times = {name: ([], []) for name in pairs}
    for round_index in range(rounds):
        for name, fns in pairs.items():
            order = (0, 1) if round_index % 2 == 0 else (1, 0)
            for which in order:
                times[name][which].append(per_call(fns[which], calls))
    return {name: (statistics.median(t), statistics.median(c)) for name, (t, c) in times.items()}


def decode_batch(num_seqs: int, context: int, vocab: int, first_block: int = 1):
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    batch = []
    for i in range(num_seqs):
        length = context - (i * 37) % max(context // 2, 1)
        seq = Sequence(request_id=str(i), token_ids=[(i * 31 + j) % vocab for j in range(length + 1)], prompt_len=length,
                       options=None, arrival=0,
                       block_table=list(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq)))
        seq.num_computed = length
        batch.append((seq, 1))
    return batch, num_seqs * blocks_per_seq


def op_pairs(config, dtype: torch.dtype, rows: int, library) -> dict[str, tuple]:
    generator = torch.Generator().manual_seed(0)
    hidden_size, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    heads = config.num_heads + config.num_kv_heads
    x = torch.randn(rows, hidden_size, generator=generator).to(dtype)
    delta = torch.randn(rows, hidden_size, generator=generator).to(dtype)
    weight = torch.randn(hidden_size, generator=generator).to(dtype)
    gate_up = torch.randn(rows, 2 * inter, generator=generator).to(dtype)
    qk = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    table = torch.randn(4096, head_dim // 2, generator=generator).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    eps = config.rms_norm_eps

    def rotary_torch():
        apply_rotary(qk, table[positions].unsqueeze(1), table[positions].unsqueeze(1))

    def add_norm_torch():
        fused_ops.rms_norm_torch(x + delta, weight, eps)

    gate, up = gate_up.chunk(2, dim=-1)
    return {
        f"rms_norm, {rows} rows": (lambda: fused_ops.rms_norm_torch(x, weight, eps),
                                   lambda: layer_ops.rms_norm(library, x, weight, eps)),
        f"residual add + rms_norm, {rows} rows": (add_norm_torch,
                                                  lambda: layer_ops.add_rms_norm(library, x.clone(), delta, weight, eps)),
        f"silu * up, {rows} rows": (lambda: torch.nn.functional.silu(gate) * up,
                                    lambda: layer_ops.silu_mul(library, gate_up)),
        f"rotary (q and k heads), {rows} rows": (rotary_torch,
                                                 lambda: layer_ops.rotary_in_place(library, qk, table, table, positions)),
    }


def attention_pairs(config, dtype: torch.dtype, library) -> dict[str, tuple]:
    """Decode attention over a pool of the model's dtype and an 8-bit (e4m3) one, at each
    level of the C kernel this CPU runs (paged_decode.LEVELS)."""
    pairs = {}
    for num_seqs, context in ((1, 160), (48, 330)):
        batch, num_blocks = decode_batch(num_seqs, context, config.vocab_size)
        pool = torch.randn(2, num_blocks + 1, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch], dtype=torch.int32)
        lens = torch.tensor([seq.num_computed + 1 for seq, _ in batch], dtype=torch.int32)
        q = torch.randn(num_seqs, config.num_heads, config.head_dim).to(dtype)
        scale = config.head_dim**-0.5
        longest = int(lens.max())
        for kv_dtype in (dtype, torch.float8_e4m3fn):
            kv_layer = pool.to(kv_dtype)
            for level in range(paged_decode.best_level(library) + 1):
                name = (f"decode attention, one layer, batch {num_seqs}, contexts up to {longest}, {kv_dtype} K/V, "
                        f"C at {paged_decode.LEVELS[level]}")
                pairs[name] = (
                    lambda q=q, kv=kv_layer, t=tables, n=lens, m=longest: decode_attention_torch(
                        q, kv, t, n, scale, max_context_len=m),
                    lambda q=q, kv=kv_layer, t=tables, n=lens, level=level: paged_decode.paged_decode_attention(
                        library, q, kv, t, n, scale, level=level),
                )
    return pairs


def argmax_pairs(config, dtype: torch.dtype, library) -> dict[str, tuple]:
    """Greedy sampling's argmax over a decode batch's logits, in the lm_head's dtype: what
    sampling.argmax_rows did before the kernel (a float32 copy, then numpy) against it."""
    logits = torch.randn(48, config.vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)

    def float_then_numpy():
        return torch.from_numpy(logits.float().contiguous().numpy().argmax(axis=-1))

    return {f"greedy argmax, 48 x {config.vocab_size} logits": (float_then_numpy,
                                                                lambda: cpu_argmax.argmax_rows(library, logits))}


def step_pairs(model_path: str, dtype: torch.dtype) -> dict[str, tuple]:
    """Whole runner.execute steps: the model with the C kernels, and the same weights with
    decode attention on the torch backend and the layer ops' C path turned off."""
    with_c = load_model(model_path, dtype, "cpu").model
    on_torch = load_model(model_path, dtype, "cpu", attention_backend="torch").model
    config = with_c.config
    original_library = fused_ops._library

    def torch_only(fn):
        def run():
            fused_ops._library = lambda *tensors: None
            try:
                fn()
            finally:
                fused_ops._library = original_library
        return run

    pairs = {}
    shapes = {"decode step, batch 1, context 160": (1, 160, 1), "decode step, batch 48, contexts up to 330": (48, 330, 1),
              "prefill step, 20 prompts of 100 tokens": (20, 100, 100)}
    for name, (num_seqs, length, new_tokens) in shapes.items():
        if new_tokens == 1:
            batch, num_blocks = decode_batch(num_seqs, length, config.vocab_size)
        else:
            blocks_per_seq = -(-length // BLOCK_SIZE)
            batch = [(Sequence(request_id=str(i), token_ids=[(i * 31 + j) % config.vocab_size for j in range(length)],
                               prompt_len=length, options=None, arrival=0,
                               block_table=list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))), length)
                     for i in range(num_seqs)]
            num_blocks = num_seqs * blocks_per_seq
        pool = torch.zeros((config.num_layers, 2, num_blocks + 1, BLOCK_SIZE, config.num_kv_heads, config.head_dim),
                           dtype=dtype)
        c_runner, torch_runner = ModelRunner(with_c, pool, BLOCK_SIZE), ModelRunner(on_torch, pool, BLOCK_SIZE)
        pairs[name] = (torch_only(lambda r=torch_runner, b=batch: r.execute(b)), lambda r=c_runner, b=batch: r.execute(b))
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, w48 or a checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--attention-only", action="store_true", help="decode attention's rows alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    library = cpu_kernels.load()
    if library is None:
        raise SystemExit(f"the C kernels did not build: {cpu_kernels.load_error()}")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = {"w48": lambda: write_w48_checkpoint(Path(tmp) / "w48"), "smollm2": smollm2_checkpoint}.get(
            args.model, lambda: Path(args.model))()
        config = load_model(str(path), dtype, "cpu").config
        results = {}
        if not args.attention_only:
            for rows in (1, 48, 2000):
                results.update(in_turns(op_pairs(config, dtype, rows, library), args.rounds,
                                        calls=200 if rows < 2000 else 20))
        results.update(in_turns(attention_pairs(config, dtype, library), args.rounds, calls=100))
        if not args.attention_only:
            results.update(in_turns(argmax_pairs(config, dtype, library), args.rounds, calls=100))
            results.update(in_turns(step_pairs(str(path), dtype), args.rounds, calls=3))
    print(f"\n{args.model}, {args.dtype}, {args.threads} threads, median of {args.rounds} rounds in turns\n")
    print("| what | torch | C kernels | torch / C |")
    print("| --- | --- | --- | --- |")
    for name, (torch_s, c_s) in results.items():
        print(f"| {name} | {torch_s * 1e3:.3f} ms | {c_s * 1e3:.3f} ms | {torch_s / c_s:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
