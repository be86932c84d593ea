"""The wheels a GPU machine's image lacks: downloaded on a CPU machine, installed on the GPU one.

The GPU image brings its own torch, triton, numpy and transformers (CUDA builds, other
versions than this project's pins) and a different Python; what the services import
beyond those (MISSING) is downloaded here for that Python and platform, each with the
dependencies it needs that the image does not bring, at the versions this checkout's
environment runs (importlib.metadata): tested together. `--no-deps` per wheel, so pip never
fetches a torch. `install` (scripts/gpu_first_run.sh runs it) installs MISSING from that
folder only (`pip install --no-index`: a dependency neither there nor in the image fails by
name), into site-packages (the launcher may replace PYTHONPATH), then imports them.

    python scripts/gpu_wheels.py download --dry-run   # what would be downloaded, nothing fetched
    python scripts/gpu_wheels.py download             # into .gpu-wheels/ (git ignores it)
    python scripts/gpu_wheels.py download --dest shared/gpu-wheels --python-version 3.12
    python scripts/gpu_wheels.py install --dest .gpu-wheels   # on the GPU machine
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ".gpu-wheels"
# What the GPU image lacks (the services' and the tests' imports beyond the image's own).
# grpcio and protobuf too: the image may carry older ones than the generated stubs require.
MISSING = ("structlog", "pyzmq", "msgspec", "cbor2", "gguf", "fastapi", "uvicorn", "xgrammar", "pytest-timeout",
           "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "redis")
# The image's own builds: never replaced (a CUDA torch, its triton, the numpy they were built for).
IMAGE_PROVIDES = ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub")
# The import names of MISSING, tried after installing.
IMPORTS = ("structlog", "zmq", "msgspec", "cbor2", "gguf", "fastapi", "uvicorn", "xgrammar", "pytest_timeout",
           "grpc", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "google.protobuf", "redis")
# manylinux2014 is manylinux_2_17; newer wheels (pydantic-core, pyzmq) tag 2_28 only.
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str | None:
    """The distribution a requirement names, or None when its marker excludes it for a
    Linux CPython (extras, older Pythons, other platforms)."""
    spec, _, marker = requirement.partition(";")
    if marker and ("extra" in marker or "python_version <" in marker or "python_full_version <" in marker or "pypy" in marker
                   or "sys_platform == \"win32\"" in marker or "platform_system == \"Windows\"" in marker):
        return None
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return normalize(match.group(1)) if match else None


def wheel_set(roots=MISSING, skip=IMAGE_PROVIDES) -> dict[str, str]:
    """{name: version} of `roots` and every dependency they pull, as installed here, less
    `skip` (and what it pulls only through them). Raises if one is not installed here."""
    skipped = {normalize(name) for name in skip}
    found: dict[str, str] = {}
    pending = [normalize(name) for name in roots]
    while pending:
        name = pending.pop()
        if name in found or name in skipped or name.startswith("nvidia-"):
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed in this environment ({sys.executable}): "
                             "prepare from the project's venv") from None
        found[name] = distribution.version
        pending.extend(dep for dep in map(_requirement_name, distribution.requires or []) if dep)
    return dict(sorted(found.items()))


def download_command(wheels: dict[str, str], dest: Path, python_version: str) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "--dest", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + [f"{name}=={version}" for name, version in wheels.items()]


def install_command(dest: Path, *extra: str) -> list[str]:
    # --upgrade: where the image has an older one (grpcio), the folder's version replaces it.
    return [sys.executable, "-m", "pip", "install", "--upgrade", "--no-index", "--find-links", str(dest), *extra,
            *MISSING]


def install(dest: Path) -> int:
    if not any(dest.glob("*.whl")):
        print(f"no wheels in {dest}: run `python scripts/gpu_wheels.py download` on a CPU machine first",
              file=sys.stderr)
        return 2
    command = install_command(dest)
    print("$ " + shlex.join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    print(result.stdout + result.stderr, flush=True)
    if result.returncode and "externally-managed" in result.stdout + result.stderr:
        # A distribution's Python (PEP 668): this machine is lent for one run; install anyway.
        command = install_command(dest, "--break-system-packages")
        print("$ " + shlex.join(command), flush=True)
        result = subprocess.run(command)
    if result.returncode:
        return result.returncode
    return subprocess.run([sys.executable, "-c", "import " + ", ".join(IMPORTS) + "; print('imports ok')"]).returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("action", choices=("download", "install"))
    parser.add_argument("--dest", default=DEFAULT_DEST,
                        help=f"folder of the wheels, relative to the repository root (default {DEFAULT_DEST})")
    parser.add_argument("--python-version", default="3.12", help="download: the GPU machine's Python, e.g. 3.12")
    parser.add_argument("--dry-run", action="store_true", help="download: list what would be downloaded; fetch nothing")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version must look like 3.12, got {args.python_version!r}")
    if args.dry_run and args.action != "download":
        parser.error("--dry-run goes with download")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dest = Path(args.dest) if Path(args.dest).is_absolute() else ROOT / args.dest
    if args.action == "install":
        return install(dest)
    wheels = wheel_set()
    command = download_command(wheels, dest, args.python_version)
    print(f"{len(wheels)} wheels for CPython {args.python_version} into {dest}:")
    for name, version in wheels.items():
        print(f"  {name}=={version}")
    print("$ " + shlex.join(command), flush=True)
    if args.dry_run:
        print("dry run: nothing downloaded")
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
