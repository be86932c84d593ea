"""The committed stubs must be what `make protos` generates from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    generator = load_generator()
    generator.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "the generator produced nothing"
    for relative in generated:
        committed = ROOT / relative
        assert committed.exists(), f"{relative} is missing: run `make protos`"
        assert committed.read_text() == (tmp_path / relative).read_text(), f"{relative} is stale: run `make protos`"


def test_enums_start_unspecified():
    from pagedkv.cache.v1 import cache_pb2
    from pagedkv.model.v1 import model_pb2

    for module in (cache_pb2, model_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED"), enum.name
