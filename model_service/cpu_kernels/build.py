"""Builds and loads the CPU kernels of csrc/ with the machine's compiler, at first use.

Why ctypes and not a torch C++ extension: the kernels need no torch headers, so they
build in seconds (about 15 on the 2-core dev machine, most of it the AVX-512 decode
attention's unrolled cases) with no torch extension toolchain, once per fresh machine,
container and CI run. The callers (paged_decode.py, layer_ops.py) pass data pointers of
tensors they have checked.

The whole library is compiled for one architecture: -march=native unless PAGEDKV_CPU_ARCH
(or PAGEDKV_CPU_LEVEL) names another, from a fixed list (baseline.py: x86-64-v3 is what an
AVX2 server runs). The shared object is cached under $PAGEDKV_KERNEL_CACHE (default
~/.cache/pagedkv/kernels), named by a hash of the sources, the compiler, its flags (the
architecture among them) and this CPU's feature flags (-march=native code must not run on
another CPU that shares the cache directory). Loading
a shared object runs its code, so a cached one is loaded only when this user owns it and
its directory and neither is writable by the group or others (nor a symlink); any other
is built again over it, and a directory others may write to is not used at all. Where
no compiler works, or PAGEDKV_CPU_KERNELS=0, `load()` returns None, with one warning,
and the torch code serves instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch

from model_service.cpu_kernels import baseline, header

log = structlog.get_logger()

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode.c", "layer_ops.c", "argmax.c", "quant_matmul.c", "quant_layout.c", "decode_stack.c", "kv_write.c",
           "bf16_matmul.c", "f32_matmul.c", "prefill_attention.c", "lora_sgmv.c",
           "lora_sgmv_bf16.c", "lora_runs.c")
# Never -ffast-math: see csrc/cpu_math.h.
BUILD_TIMEOUT_S = 300
# -Werror=missing-prototypes: an exported function must be declared in csrc/pagedkv_kernels.h,
# whose prototypes give the ctypes signatures (header.py).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Werror=missing-prototypes")
# The storage types the kernels take (cpu_math.h's enum).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# And the 8-bit K/V paged decode attention reads besides.
KV_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None
_arch: str | None = None  # the architecture the loaded library was built for


def flags(arch: str = "native") -> tuple[str, ...]:
    """FLAGS with the library built for `arch` (one of baseline.ARCHES) instead of native."""
    if arch not in baseline.ARCHES:
        raise ValueError(f"{baseline.ARCH_ENV}={arch!r}: expected one of {', '.join(baseline.ARCHES)}")
    return tuple(f"-march={arch}" if flag == "-march=native" else flag for flag in FLAGS)


def cache_dir() -> Path:
    configured = os.environ.get("PAGEDKV_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pagedkv" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(compiler: str, arch: str = "native") -> Path:
    """Where the library built by `compiler` from these sources for `arch` is cached."""
    sources = [part for path in sorted(CSRC.rglob("*")) if path.suffix in (".c", ".h")
               for part in (path.relative_to(CSRC).as_posix().encode(), path.read_bytes())]
    key = hashlib.sha256(b"\0".join([*sources, compiler.encode(), " ".join(flags(arch)).encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:20]
    return cache_dir() / f"pagedkv-cpu-{key}.so"


def find_compiler() -> str | None:
    """The compiler load() builds with: $CC, else cc, else gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def untrusted(path: Path) -> str | None:
    """Why `path` may hold code someone else put there, or None when only this user could."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symlink"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _build(compiler: str, arch: str = "native") -> Path:
    target = library_path(compiler, arch)
    build_flags = flags(arch)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory_problem = untrusted(target.parent)
    if directory_problem:
        raise RuntimeError(f"the kernel cache directory is not safe to load code from: {directory_problem}; "
                           "set PAGEDKV_KERNEL_CACHE to a directory only this user can write")
    if target.exists():
        problem = untrusted(target)
        if problem is None:
            return target
        log.warning("cpu kernels cached by someone else; building them again over it", reason=problem)
    # Built under a temporary name and renamed: a concurrent start never loads half a file.
    # Each source compiles in its own process, all at once, then one link: on a loaded
    # 2-core machine one sequential compile of every source took past two minutes.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        compile_flags = [flag for flag in build_flags if flag != "-shared"]
        objects = [Path(scratch) / f"{Path(name).stem}.o" for name in SOURCES]
        jobs = [subprocess.Popen([compiler, *compile_flags, "-c", "-o", str(obj), str(CSRC / name)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for name, obj in zip(SOURCES, objects)]
        failures = []
        try:
            for job in jobs:
                _, stderr = job.communicate(timeout=BUILD_TIMEOUT_S)
                if job.returncode != 0:
                    failures.append(stderr.strip())
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()
                    job.wait()
        if failures:
            raise RuntimeError(f"{compiler} failed: {' '.join(failures)[-2000:]}")
        result = subprocess.run([compiler, *build_flags, "-o", str(built), *map(str, objects), "-lm"],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        built.chmod(0o755)  # whatever the umask: a group-writable build would not be loaded again
        os.replace(built, target)
    log.info("cpu kernels built", path=str(target), compiler=compiler, arch=arch)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None (with one warning) where it cannot be.
    Built for baseline.arch(), read at the first call: a PAGEDKV_CPU_ARCH or
    PAGEDKV_CPU_LEVEL not on its list is a ValueError (raised again at each call), not a
    quiet fall back to the torch code."""
    global _library, _load_error, _arch
    if _library is not None or _load_error is not None:  # every layer op asks: no lock once decided
        return _library
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        if os.environ.get("PAGEDKV_CPU_KERNELS", "1") == "0":
            _load_error = "PAGEDKV_CPU_KERNELS=0"
            return None
        arch = baseline.arch()
        compiler = find_compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler (cc or gcc) on PATH and CC unset")
            signatures = header.signatures()
            path = _build(compiler, arch)
            library = ctypes.CDLL(str(path))
        except Exception as error:  # a failed build must leave the service on the torch path
            _load_error = str(error)
            log.warning("cpu kernels unavailable; decode attention and the layer ops take the slower torch path",
                        reason=_load_error)
            return None
        for name, (argtypes, restype) in signatures.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = restype
        _library, _arch = library, arch
        # Each family's level is logged where it is chosen (levels.py), once per process.
        log.info("cpu kernels loaded", path=str(path), arch=arch)
        return library


def load_error() -> str | None:
    return _load_error


def loaded_arch() -> str | None:
    """The architecture the loaded library was built for (None before it loaded, or where it did not)."""
    return _arch
