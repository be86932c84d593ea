"""The AVX2 level as two builds compile it, in turns in one process: the kernel library built
for -march=native (what forcing each family's switch to avx2 ran on an AVX-512 machine) and
built for x86-64-v3 (what PAGEDKV_CPU_LEVEL=avx2 builds, and what an AVX2 server runs:
cpu_kernels/baseline.py), both loaded at once, every call at its family's avx2 level; the
layer ops and argmax, which have no levels, as each build compiles them.

    PYTHONPATH=$PWD .venv/bin/python -m bench.kernels.arch_ab [--threads 1] [--rounds 5]
        [--seconds 0.2] [--clock thread|wall] [--arches native,x86-64-v3]

SmolLM2-135M's shapes: the fused gate/up linear (3072 x 576) in float32 and bfloat16
panels and Q4_1 blocks, decode attention over 48 sequences of 512 keys, prefill attention
of 4 prompts of 512, a norm, SiLU-and-multiply and rotary over 48 or 256 rows, argmax over
48 rows of its vocabulary. Each row: the best round's µs a call on each build and the
first build's time over each other's (below 1: the first ran faster, which is what the old
forced-AVX2 numbers gained from it). Each path is checked against the first build's
result first. With --threads 1 --clock thread (the default) it times the calling
thread's CPU time, steadier on a machine other work shares.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch
from torch import nn

from bench.kernels.quant_product import add_turn_arguments, best_in_turns
from harness.random_quant_blocks import random_blocks
from model_service.cpu_kernels import (argmax, baseline, bf16_matmul, build, f32_matmul, header, layer_ops,
                                       paged_decode, prefill_attention, quant_matmul)
from model_service.models.panel_linear import PanelLinear

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
ROWS, COLS = 3072, 576  # SmolLM2's fused gate/up
BLOCK, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def libraries(arches: list[str]) -> dict[str, ctypes.CDLL]:
    """Each architecture's library, built (or found in the kernel cache) and bound as load() binds it."""
    compiler = build.find_compiler()
    signatures = header.signatures()
    found = {}
    for arch in arches:
        library = ctypes.CDLL(str(build._build(compiler, arch)))  # RTLD_LOCAL: each keeps its own symbols
        for name, (argtypes, restype) in signatures.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, restype
        found[arch] = library
    return found


def on(library: ctypes.CDLL, call):
    """`call` with load() answering `library` (the panel linears ask load() for theirs)."""
    def run():
        build._library = library
        return call()
    return run


def workloads() -> dict:
    """name -> function(library) -> a call to time."""
    torch.manual_seed(0)
    found = {}
    for dtype, module in ((torch.float32, f32_matmul), (torch.bfloat16, bf16_matmul)):
        linear = nn.Linear(COLS, ROWS, bias=False).to(dtype)
        panels = PanelLinear.from_linear(linear, module.LEVELS.index("avx2"))
        for tokens in (1, 48, 256):
            x = torch.randn(tokens, COLS).to(dtype)
            found[f"{str(dtype)[6:]} panels, gate/up, {tokens} tokens"] = \
                lambda library, x=x, panels=panels: on(library, lambda: panels(x))
    blocks = torch.from_numpy(random_blocks(3, ROWS, COLS, seed=1))
    segments = None
    quant_level = quant_matmul.LEVELS.index("avx2")
    for tokens in (1, 48):
        x = torch.randn(tokens, COLS)

        def quant(library, x=x):
            nonlocal segments
            if segments is None:  # the interleaved layout: the same bytes whichever library lays them out
                segments = quant_matmul.Segments([(quant_matmul.repack(library, 3, blocks), blocks)], COLS)
            return lambda: quant_matmul.linear(library, x, segments, quant_level, float_from=None)
        found[f"Q4_1 integer product, gate/up, {tokens} tokens"] = quant

    seqs, context = 48, 512
    per_seq = context // BLOCK
    pool = torch.randn(2, seqs * per_seq + 1, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    tables = torch.arange(1, seqs * per_seq + 1, dtype=torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, Q_HEADS, HEAD_DIM).to(torch.bfloat16)
    decode_level = paged_decode.LEVELS.index("avx2")
    found["decode attention, bf16, 48 x 512 keys"] = lambda library: lambda: paged_decode.paged_decode_attention(
        library, q, pool, tables, lens, HEAD_DIM ** -0.5, level=decode_level)

    prompts = [512] * 4
    prefill_level = prefill_attention.LEVELS.index("avx2")
    for dtype in (torch.float32, torch.bfloat16):
        prefill_pool = torch.randn(2, 4 * 32 + 1, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
        prefill_tables = torch.arange(1, 4 * 32 + 1, dtype=torch.int32).view(4, 32)
        sequences = prefill_attention.prefill_sequences(prefill_tables, prompts, prompts)
        prefill_q = torch.randn(sum(prompts), Q_HEADS, HEAD_DIM).to(dtype)

        def prefill(library, prefill_q=prefill_q, prefill_pool=prefill_pool, sequences=sequences):
            def run():
                out = torch.empty_like(prefill_q)
                prefill_attention.prefill_attention(library, prefill_q, prefill_pool, sequences, HEAD_DIM ** -0.5,
                                                    None, out, level=prefill_level)
                return out
            return run
        found[f"prefill attention, {str(dtype)[6:]}, 4 x 512"] = prefill

    for rows in (48, 256):
        hidden = torch.randn(rows, COLS).to(torch.bfloat16)
        weight = torch.randn(COLS).to(torch.bfloat16)
        gate_up = torch.randn(rows, 2 * 1536).to(torch.bfloat16)
        found[f"rms_norm, bf16, {rows} x 576"] = \
            lambda library, hidden=hidden, weight=weight: lambda: layer_ops.rms_norm(library, hidden, weight, 1e-5)
        found[f"silu_mul, bf16, {rows} x 1536"] = \
            lambda library, gate_up=gate_up: lambda: layer_ops.silu_mul(library, gate_up)
    qk = torch.randn(48, 12, HEAD_DIM).to(torch.bfloat16)
    angles = torch.rand(4096, HEAD_DIM // 2) * 6.28  # rotations: repeated in place, the values stay finite
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    positions = torch.randint(0, 4096, (48,), dtype=torch.int64)

    def rotary(library):
        def run():
            layer_ops.rotary_in_place(library, qk, cos, sin, positions)
            return qk.clone()
        return run
    found["rotary, bf16, 48 x 12 heads (in place)"] = rotary
    logits = torch.randn(48, 49152).to(torch.bfloat16)
    found["argmax, bf16, 48 x 49152"] = lambda library: lambda: argmax.argmax_rows(library, logits)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_turn_arguments(parser, seconds=0.2)
    parser.set_defaults(threads=1, rounds=5)
    parser.add_argument("--clock", choices=CLOCKS, default="thread",
                        help="thread: the calling thread's CPU time (only with --threads 1)")
    parser.add_argument("--arches", default="native,x86-64-v3", help=f"from {', '.join(baseline.ARCHES)}")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread times the calling thread alone: use it with --threads 1")
    arches = args.arches.split(",")
    torch.set_num_threads(args.threads)
    built = libraries(arches)
    first = arches[0]
    print(f"{args.threads} threads, {args.clock} clock, every levelled call at avx2; µs a call, best of {args.rounds}")
    print(f"| path | {' | '.join(arches)} | {' | '.join(f'{first} / {arch}' for arch in arches[1:])} |")
    print("| --- " * (1 + 2 * len(arches) - 1) + "|")
    for name, make in workloads().items():
        calls = {arch: make(library) for arch, library in built.items()}
        if "in place" not in name:  # in place: each call starts from the last one's result
            reference = calls[first]()
            for arch in arches[1:]:
                torch.testing.assert_close(calls[arch]().float(), reference.float(), atol=3e-2, rtol=3e-2)
        best = best_in_turns(calls, args.rounds, args.seconds, CLOCKS[args.clock])
        ratios = " | ".join(f"{best[first] / best[arch]:.2f}" for arch in arches[1:])
        print(f"| {name} | {' | '.join(f'{best[arch]:,.1f}' for arch in arches)} | {ratios} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
