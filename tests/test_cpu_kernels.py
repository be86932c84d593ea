"""The C decode-attention kernel (model_service/cpu_kernels/paged_decode.py): the same answers
as the torch path at every specialized head dim and the generic one; and the kernels' build:
cached, and where it fails a service that still serves on the torch code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from model_service import cpu_kernels
from model_service.cpu_kernels import paged_decode
from model_service.attention.torch_paged import decode_attention_torch

from kernel_levels import level_fixture

level = level_fixture(paged_decode)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def random_decode_step(num_seqs, q_heads, kv_heads, head_dim, block_size, max_context, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-max_context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 4
    kv_layer = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq].view(num_seqs, -1)
    lens = torch.randint(1, max_context + 1, (num_seqs,), generator=generator, dtype=torch.int32)
    lens[0] = max_context
    # q as the model hands it over: a view of the fused q/k/v rows, rows further apart than q_heads * D.
    qkv = torch.randn(num_seqs, q_heads + 2 * kv_heads, head_dim, generator=generator).to(dtype)
    return qkv[:, :q_heads], kv_layer, tables.to(torch.int32), lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256, 48])  # 48: the generic path
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4), (14, 2)])
def test_kernel_matches_the_torch_path(level, dtype, head_dim, q_heads, kv_heads):
    q, kv_layer, tables, lens = random_decode_step(5, q_heads, kv_heads, head_dim, 16, 70, dtype)
    scale = head_dim**-0.5
    library = cpu_kernels.load()
    assert library is not None, cpu_kernels.load_error()

    out = paged_decode.paged_decode_attention(library, q, kv_layer, tables, lens, scale)

    expected = decode_attention_torch(q, kv_layer, tables, lens, scale, max_context_len=int(lens.max()))
    assert out.shape == (5, q_heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [1, 8, 32])
@pytest.mark.parametrize("window", [None, 1, 13, 64])
def test_kernel_block_sizes_and_windows(level, block_size, window):
    q, kv_layer, tables, lens = random_decode_step(7, 8, 2, 64, block_size, 150, torch.float32, seed=block_size)
    library = cpu_kernels.load()

    out = paged_decode.paged_decode_attention(library, q, kv_layer, tables, lens, 0.125, sliding_window=window)

    expected = decode_attention_torch(q, kv_layer, tables, lens, 0.125, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 4, 5, 8, 16])  # the AVX-512 case goes in passes of up to 4 heads
@pytest.mark.parametrize(("block_size", "window"), [(16, None), (8, 300), (32, 77)])
def test_kernel_over_several_spans_of_keys(level, dtype, head_dim, group, block_size, window):
    """Contexts past the AVX-512 case's 256-key span and the AVX2 case's 128 (their softmax
    folds spans together), short ones, and windows that start mid-block."""
    q, kv_layer, tables, lens = random_decode_step(4, 2 * group, 2, head_dim, block_size, 700, dtype, seed=group)
    lens[1], lens[2] = 256, 17
    library = cpu_kernels.load()

    out = paged_decode.paged_decode_attention(library, q, kv_layer, tables, lens, head_dim**-0.5, sliding_window=window)

    expected = decode_attention_torch(q, kv_layer, tables, lens, head_dim**-0.5, sliding_window=window)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_empty_context_gives_zeros_not_nan(level):
    q, kv_layer, tables, lens = random_decode_step(3, 4, 2, 64, 16, 20, torch.float32)
    lens[1] = 0  # a padded batch entry
    out = paged_decode.paged_decode_attention(cpu_kernels.load(), q, kv_layer, tables, lens, 0.125)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_shapes_past_the_kernel_limits_take_the_torch_path():
    from model_service.attention.backend import PagedAttention

    q = torch.zeros(1, 2, 512)
    kv_layer = torch.zeros(2, 1, 16, 1, 512)
    assert not paged_decode.supports(q, kv_layer)
    assert PagedAttention("auto").select(q, kv_layer).name == "torch"
    assert not paged_decode.supports(q, kv_layer.transpose(1, 2))  # not the pool's contiguous layout


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    # The bound only ends a hang (none of these runs compiles the kernels).
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


def cpu_flags() -> set[str]:
    return set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())


def test_the_avx512_case_is_built_where_the_cpu_has_avx512():
    """So that on such a CPU the tests above check it (and elsewhere the portable kernel)."""
    assert cpu_kernels.load().paged_decode_avx512() == int("avx512f" in cpu_flags())


def test_the_best_level_is_the_cpus_and_auto_takes_it(monkeypatch):
    """An x86-64 CPU with AVX2, FMA and F16C (and no AVX-512) runs the AVX2 case, whatever
    -march the library was built for."""
    flags = cpu_flags()
    expected = 2 if "avx512f" in flags else 1 if {"avx2", "fma", "f16c"} <= flags else 0
    assert paged_decode.best_level(cpu_kernels.load()) == expected
    monkeypatch.setenv(paged_decode.ENV, "auto")
    assert paged_decode.chosen_level() == expected


def test_a_level_the_cpu_lacks_or_an_unknown_one_is_refused(monkeypatch):
    best = paged_decode.best_level(cpu_kernels.load())
    q, kv_layer, tables, lens = random_decode_step(2, 4, 2, 64, 16, 20, torch.float32)
    for name in paged_decode.LEVELS[best + 1:]:
        monkeypatch.setenv(paged_decode.ENV, name)
        with pytest.raises(ValueError, match=f"{paged_decode.ENV}={name}: this CPU runs"):
            paged_decode.paged_decode_attention(cpu_kernels.load(), q, kv_layer, tables, lens, 0.125)
    monkeypatch.setenv(paged_decode.ENV, "sse9")
    with pytest.raises(ValueError, match="expected one of auto, portable, avx2, avx512"):
        paged_decode.chosen_level()
    # the C side refuses a level above the CPU's too, rather than running an illegal instruction
    with pytest.raises(ValueError, match="refused"):
        paged_decode.paged_decode_attention(cpu_kernels.load(), q, kv_layer, tables, lens, 0.125, level=best + 1)


def stand_in_compiler(tmp_path, library) -> tuple[Path, Path]:
    """A compiler that logs each call and, at the link, copies the library this process
    already loaded to where -o says: a build in no time that load() can still bind,
    since compiling the real sources is what every other test here has done already."""
    calls = tmp_path / "compiler-calls"
    compiler = tmp_path / "cc"
    compiler.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> '{calls}'
        out=; previous=; link=yes
        for arg; do [ "$previous" = -o ] && out=$arg; [ "$arg" = -c ] && link=; previous=$arg; done
        if [ -n "$link" ]; then cp '{library}' "$out"; else : > "$out"; fi
    """))
    compiler.chmod(0o755)
    return compiler, calls


def test_built_once_then_found_in_the_cache(tmp_path, monkeypatch):
    from model_service.cpu_kernels import build

    library = cpu_kernels.load()
    assert library is not None, cpu_kernels.load_error()
    compiler, calls = stand_in_compiler(tmp_path, library._name)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(cache))

    target = build._build(str(compiler))
    assert len(calls.read_text().splitlines()) == len(build.SOURCES) + 1  # each source, then the link
    assert list(cache.iterdir()) == [target]  # no scratch left behind
    assert build.untrusted(target) is None and build.untrusted(cache) is None  # what a later load requires

    # A fresh process with the same compiler loads it from the cache: no compiler call, no build.
    code = """
        from model_service import cpu_kernels
        assert cpu_kernels.load() is not None, cpu_kernels.load_error()
        assert cpu_kernels.load().paged_decode_avx512() in (0, 1)  # the signatures bound
    """
    second = run_python(code, PAGEDKV_KERNEL_CACHE=str(cache), CC=str(compiler))
    assert second.returncode == 0, second.stderr
    assert "cpu kernels built" not in second.stdout + second.stderr
    assert "cpu kernels loaded" in second.stdout + second.stderr
    assert len(calls.read_text().splitlines()) == len(build.SOURCES) + 1


@pytest.mark.parametrize("env", [{"CC": "false"}, {"PAGEDKV_CPU_KERNELS": "0"}], ids=["compiler fails", "disabled"])
def test_without_the_kernel_auto_serves_on_torch_and_cpu_refuses(tmp_path, env):
    result = run_python("""
        import torch
        from model_service import cpu_kernels
        from model_service.attention.backend import PagedAttention
        assert cpu_kernels.load() is None
        print("reason:", cpu_kernels.load_error())
        assert PagedAttention("auto").select(torch.zeros(1, 1, 4), torch.zeros(2, 1, 8, 1, 4)).name == "torch"
        from model_service.models import fused_ops  # the layer ops fall back to their torch code
        gate_up = torch.randn(3, 8)
        assert torch.equal(fused_ops.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:])
        try:
            PagedAttention("cpu")
        except RuntimeError as error:
            print("refused:", error)
    """, PAGEDKV_KERNEL_CACHE=str(tmp_path), **env)
    assert result.returncode == 0, result.stderr
    assert "refused: attention backend 'cpu' requested but its C kernels did not build" in result.stdout
    if "CC" in env:
        assert "reason: false failed" in result.stdout
        assert "cpu kernels unavailable" in result.stdout + result.stderr  # the one warning
    assert not list(tmp_path.glob("*.so"))


def test_a_cached_library_others_could_write_is_built_again_not_loaded(tmp_path, monkeypatch):
    from model_service.cpu_kernels import build

    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path / "cache"))
    # A stand-in compiler that writes a marker where -o says: what matters here is which
    # file _build hands to the loader, not the code in it.
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho built > "$2"\n')
    compiler.chmod(0o755)
    target = build.library_path(str(compiler))
    target.parent.mkdir(mode=0o700, parents=True)
    target.write_text("planted\n")
    target.chmod(0o666)  # world-writable: anyone could have put code there
    assert build._build(str(compiler)) == target
    assert target.read_text() == "built\n" and target.stat().st_mode & 0o022 == 0
    # A directory others may write to is not used at all.
    (tmp_path / "cache").chmod(0o777)
    with pytest.raises(RuntimeError, match="kernel cache directory is not safe"):
        build._build(str(compiler))
