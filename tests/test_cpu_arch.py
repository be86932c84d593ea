"""The library built for another architecture than this CPU's (cpu_kernels/baseline.py:
PAGEDKV_CPU_ARCH, PAGEDKV_CPU_LEVEL): what an AVX2 server runs, measured and tested here.

- Built for x86-64-v3, no function outside the AVX-512 levels' uses an AVX-512 instruction
  (tests/avx512_code.py states the rule); built for native on an AVX-512 CPU they do, which
  is why the switch exists.
- The forced-level correctness tests of every family pass at their avx2 level on the
  x86-64-v3 build, and those of the 8-bit K/V reads (cpu_math.h's code without F16C) at
  portable and avx2 on the x86-64 build: each a pytest run of its own, since a process loads
  one library.
- Only the listed architectures and levels reach the compiler.

Each build is cached like any other (build.py), so it costs its 15 s once per sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from avx512_code import avx512_functions, disassemble, instructions, packed_ymm_arithmetic, stray_avx512
from model_service.cpu_kernels import baseline, build, levels

COMPILER = build.find_compiler()
OBJDUMP = shutil.which("objdump")
ROOT = Path(__file__).parents[1]

needs_x86_compiler = pytest.mark.skipif(COMPILER is None or not baseline.is_x86(), reason="needs x86 and a C compiler")


def cpu_flags() -> set[str]:
    return set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())


@pytest.fixture(scope="session")
def built():
    """The library built for an architecture (cached per sources, compiler and architecture)."""
    libraries: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in libraries:
            libraries[arch] = build._build(COMPILER, arch)
        return libraries[arch]

    return get


def strays(library: Path, arch: str) -> dict[str, list[str]]:
    allowed = avx512_functions(COMPILER, build.flags(arch), [build.CSRC / name for name in build.SOURCES])
    return stray_avx512(OBJDUMP, library, allowed)


def summary(found: dict[str, list[str]]) -> str:
    return "; ".join(f"{name}: {len(uses)} ({uses[0]})" for name, uses in sorted(found.items())[:20])


@needs_x86_compiler
@pytest.mark.skipif(OBJDUMP is None, reason="no objdump")
def test_built_for_x86_64_v3_only_the_avx512_levels_use_avx512(built):
    found = strays(built("x86-64-v3"), "x86-64-v3")
    assert not found, f"AVX-512 outside the AVX-512 levels' functions: {summary(found)}"


@needs_x86_compiler
@pytest.mark.skipif(OBJDUMP is None, reason="no objdump")
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="this CPU lacks AVX-512F: its native build is not one")
def test_built_for_native_on_an_avx512_cpu_the_rest_uses_avx512_too(built):
    """What the x86-64-v3 build is for, and that the check above can fail: native code
    outside the AVX-512 levels (the AVX2 levels, the portable code) is AVX-512 code here."""
    found = strays(built("native"), "native")
    assert found
    assert any(name.endswith("_avx2") or "avx2" in name for name in found), summary(found)


@needs_x86_compiler
@pytest.mark.skipif(OBJDUMP is None, reason="no objdump")
def test_built_for_x86_64_v3_the_layer_ops_are_vectorized(built):
    """What an AVX2 server runs of the code outside the levels is vectorized too: without
    AVX-512's masks GCC leaves a loop with a branch in it scalar, and SiLU-and-multiply was
    (exp_f32's clamp and bfloat16's NaN case in cpu_math.h are selects by masks for it)."""
    packed = packed_ymm_arithmetic(disassemble(OBJDUMP, built("x86-64-v3")))
    scalar = [name for name in ("silu_mul", "rms_norm", "add_rms_norm", "rotary_in_place") if not packed.get(name)]
    assert not scalar, f"no packed float32 arithmetic on ymm registers in {scalar}"


@needs_x86_compiler
@pytest.mark.skipif(OBJDUMP is None, reason="no objdump")
@pytest.mark.parametrize("arch", ["native", "x86-64-v3"])
def test_exp_f32_is_inlined_everywhere(built, arch):
    """A call to exp_f32 is one element at a time. Where a file lowers the optimization
    level (paged_decode_avx512.h's O2), GCC stopped inlining it once its clamp grew, and
    decode attention's softmax called it for every score."""
    calls = sorted({function for function, _, text in instructions(disassemble(OBJDUMP, built(arch)))
                    if text.startswith("call") and "<exp_f32" in text})
    assert not calls, f"exp_f32 called out of line from {calls}"


def pytest_run(arch: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, baseline.ARCH_ENV: arch}
    for name in levels.switches():
        if name != baseline.ARCH_ENV:
            env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-o", "addopts=", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@needs_x86_compiler
def test_every_familys_avx2_level_passes_its_tests_on_the_x86_64_v3_build(built):
    built("x86-64-v3")  # in the cache before the run (and built once however many runs ask)
    files = ["tests/test_f32_matmul.py", "tests/test_bf16_matmul.py", "tests/test_quant_kernels.py",
             "tests/test_cpu_kernels.py", "tests/test_kv_fp8_kernels.py", "tests/test_prefill_attention.py",
             "tests/test_lora_kernel.py", "tests/test_lora_runs.py"]
    result = pytest_run("x86-64-v3", *files, "-k", "avx2 and not avx512")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "cpu kernel library: built for -march=x86-64-v3" in result.stdout
    for family in levels.families():
        assert f"cpu kernel levels, {family.name}: tested avx2" in result.stdout, result.stdout[-3000:]


@needs_x86_compiler
def test_without_f16c_the_8_bit_reads_and_the_layer_ops_pass_on_the_x86_64_build(built):
    """cpu_math.h converts 8-bit K/V with F16C where -march has it; built for x86-64, the
    integer conversion serves the portable and AVX2 levels alike."""
    built("x86-64")
    result = pytest_run("x86-64", "tests/test_kv_fp8_kernels.py", "tests/test_layer_ops.py", "-k", "not avx512")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "cpu kernel library: built for -march=x86-64" in result.stdout


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {name: value for name, value in os.environ.items() if name not in levels.switches()}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**environment, **env})


@needs_x86_compiler
def test_cpu_level_avx2_builds_for_x86_64_v3_and_runs_every_family_at_avx2(built, tmp_path):
    built("x86-64-v3")
    result = run_python("""
        from model_service.cpu_kernels import build, levels
        assert build.load() is not None, build.load_error()
        print("arch", build.loaded_arch())
        for family in levels.families():
            print("level", family.name, levels.choose(family.name))
    """, PAGEDKV_CPU_LEVEL="avx2", PAGEDKV_BF16_KERNELS="portable")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "arch x86-64-v3" in lines
    for family in levels.families():
        # a family's own switch still wins
        expected = "portable" if family.env == "PAGEDKV_BF16_KERNELS" else "avx2"
        assert f"level {family.name} {expected}" in lines
    assert "PAGEDKV_CPU_LEVEL=avx2 and PAGEDKV_F32_KERNELS unset" in result.stdout + result.stderr
    assert "the library built for x86-64-v3" in result.stdout + result.stderr


def on_x86_with(env: dict[str, str], monkeypatch) -> None:
    """An x86 machine whose two process-wide switches are `env`'s (unset where it has none)."""
    monkeypatch.delenv(baseline.ARCH_ENV, raising=False)
    monkeypatch.delenv(baseline.LEVEL_ENV, raising=False)
    monkeypatch.setattr(baseline, "is_x86", lambda: True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(("env", "message"), [
    ({"PAGEDKV_CPU_ARCH": "skylake-avx512"}, "PAGEDKV_CPU_ARCH='skylake-avx512': expected one of native, x86-64,"),
    ({"PAGEDKV_CPU_ARCH": "native -fplugin=x.so"}, "PAGEDKV_CPU_ARCH='native -fplugin=x.so': expected one of"),
    ({"PAGEDKV_CPU_LEVEL": "avx512"}, "PAGEDKV_CPU_LEVEL='avx512': expected one of auto, avx2, portable"),
    ({"PAGEDKV_CPU_LEVEL": "sse9", "PAGEDKV_CPU_ARCH": "x86-64-v3"}, "PAGEDKV_CPU_LEVEL='sse9': expected one of"),
])
def test_anything_off_the_lists_is_refused_before_the_compiler(env, message, monkeypatch):
    on_x86_with(env, monkeypatch)
    with pytest.raises(ValueError, match=message):
        baseline.arch()


def test_the_flags_take_only_a_listed_architecture():
    with pytest.raises(ValueError, match="PAGEDKV_CPU_ARCH='x86-64-v3 -O0': expected one of"):
        build.flags("x86-64-v3 -O0")


def test_an_x86_architecture_is_refused_elsewhere(monkeypatch):
    monkeypatch.setattr(baseline, "is_x86", lambda: False)
    monkeypatch.setenv(baseline.ARCH_ENV, "x86-64-v3")
    with pytest.raises(ValueError, match="PAGEDKV_CPU_ARCH=x86-64-v3 names an x86 architecture"):
        baseline.arch()
    monkeypatch.delenv(baseline.ARCH_ENV)
    monkeypatch.setenv(baseline.LEVEL_ENV, "avx2")
    assert baseline.arch() == "native"  # the level alone still caps each family's default


def test_a_bad_switch_is_an_error_from_load_not_the_torch_path(tmp_path):
    result = run_python("""
        from model_service.cpu_kernels import build
        try:
            build.load()
        except ValueError as error:
            print("refused:", error)
    """, PAGEDKV_CPU_ARCH="znver5", PAGEDKV_KERNEL_CACHE=str(tmp_path))
    assert "refused: PAGEDKV_CPU_ARCH='znver5': expected one of native, x86-64, x86-64-v2, x86-64-v3, x86-64-v4" \
        in result.stdout, result.stderr
    assert not list(tmp_path.iterdir())  # nothing built


@pytest.mark.parametrize(("env", "arch"), [
    ({}, "native"),
    ({"PAGEDKV_CPU_LEVEL": "avx2"}, "x86-64-v3"),
    ({"PAGEDKV_CPU_LEVEL": "Portable "}, "x86-64"),
    ({"PAGEDKV_CPU_LEVEL": "auto"}, "native"),
    ({"PAGEDKV_CPU_LEVEL": "avx2", "PAGEDKV_CPU_ARCH": "native"}, "native"),  # the architecture's own switch wins
    ({"PAGEDKV_CPU_ARCH": "x86-64-v2"}, "x86-64-v2"),
])
def test_the_architecture_follows_the_switches(env, arch, monkeypatch):
    on_x86_with(env, monkeypatch)
    assert baseline.arch() == arch


def test_each_architecture_is_a_library_of_its_own():
    paths = {build.library_path("cc", arch) for arch in baseline.ARCHES}
    assert len(paths) == len(baseline.ARCHES)
    assert build.flags("native") == build.FLAGS
    assert "-march=x86-64-v3" in build.flags("x86-64-v3") and "-march=native" not in build.flags("x86-64-v3")
