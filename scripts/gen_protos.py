"""Regenerates the Python gRPC stubs from proto/ into pagedkv/ (run: make protos).

The generated modules live in their own packages (pagedkv.cache.v1, pagedkv.model.v1)
so no hand-written module is ever overwritten. tests/test_protos.py fails when the
committed stubs differ from what this script produces.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under proto/."""
    well_known = Path(protoc.__file__).parent / "_proto"
    for proto in proto_files():
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {proto}")
        # Every level must be a regular package so `import pagedkv.cache.v1` works.
        package = proto.parent.relative_to(PROTO_ROOT).parts
        for depth in range(1, len(package) + 1):
            out_dir.joinpath(*package[:depth], "__init__.py").touch(exist_ok=True)


def main() -> int:
    generate(ROOT)
    for proto in proto_files():
        print(f"generated stubs for {proto.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
