"""Sizing: units, KV geometry, the pool formula and the offline calculator, on hand-computed numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache_service.api import sizing_cli, wire
from cache_service.core.sizing import (
    SizingError,
    SizingReport,
    _read_meminfo,
    measure_device_memory,
    size_pool,
)
from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import KvGeometry, dtype_from_name, dtype_from_proto, dtype_name
from pagedkv.units import format_bytes, parse_bytes

REPO = Path(__file__).resolve().parents[1]
KiB, MiB, GiB = 2**10, 2**20, 2**30

# Llama-3-8B's KV shape: 2 × 32 × 16 × 8 × 128 × 2 bytes = exactly 2 MiB a block.
LLAMA3_8B = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
# A small fp32 model: 2 × 4 × 16 × 4 × 32 × 4 bytes = 64 KiB a block.
TINY_CPU = KvGeometry(num_layers=4, num_kv_heads=4, head_dim=32, dtype=torch.float32, device="cpu")

LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
# embedding 128256×4096 + 32 × (q 4096² + k,v 2×4096×1024 + o 4096² + MLP 3×4096×14336
# + 2 norms 2×4096) + final norm 4096 + lm_head 128256×4096: the published 8.03B.
LLAMA3_8B_PARAMETERS = 8_030_261_248


# ---- units -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("64MiB", 64 * MiB),
        ("64mib", 64 * MiB),
        ("64 MiB", 64 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("2KB", 2000),
        ("3mb", 3_000_000),
        ("1GB", 10**9),
        ("1TiB", 2**40),
        ("10B", 10),
        ("0", 0),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-5", "1.5", "1e9", "64 MiB extra", -1, True, None, 1.5])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="byte|bytes"):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(2 * MiB) == "2.00 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(-570 * MiB) == "-570.00 MiB"
    assert format_bytes(2**50) == "1024.00 TiB"


# ---- KvGeometry ----------------------------------------------------------------------


def test_llama3_block_is_exactly_two_mib():
    assert LLAMA3_8B.dtype_bytes == 2
    assert LLAMA3_8B.bytes_per_token == 128 * KiB
    assert LLAMA3_8B.bytes_per_block(16) == 2 * MiB
    assert LLAMA3_8B.pool_shape(100, 16) == (32, 2, 100, 16, 8, 128)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 1.5},
        {"head_dim": True},
        {"dtype": torch.int8},
        {"device": "tpu"},
        {"device": "cuda:x"},
    ],
)
def test_geometry_rejects(kwargs):
    values = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": torch.float16, "device": "cpu", **kwargs}
    with pytest.raises(ValueError):
        KvGeometry(**values)


def test_geometry_proto_round_trip():
    for device in ("cpu", "cuda", "cuda:3"):
        geometry = KvGeometry(2, 4, 64, torch.float16, device)
        assert KvGeometry.from_proto(geometry.to_proto()) == geometry
    assert LLAMA3_8B.to_proto().dtype == cache_pb2.DTYPE_BFLOAT16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": cache_pb2.DTYPE_UNSPECIFIED}, "DTYPE_UNSPECIFIED"),
        ({"num_layers": 0}, "num_layers is 0"),
        ({"head_dim": 0}, "head_dim is 0"),
        ({"device": ""}, "device is empty"),
        ({"device": "gpu"}, "unsupported device"),
    ],
)
def test_geometry_from_proto_rejects(change, message):
    values = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": cache_pb2.DTYPE_FLOAT32, "device": "cpu"}
    with pytest.raises(ValueError, match=message):
        KvGeometry.from_proto(cache_pb2.Geometry(**{**values, **change}))


def test_dtype_names():
    assert dtype_from_name("bfloat16") is torch.bfloat16
    assert dtype_from_name("BF16") is torch.bfloat16
    assert dtype_from_name("torch.float16") is torch.float16
    assert dtype_name(torch.float32) == "float32"
    assert dtype_from_proto(cache_pb2.DTYPE_FLOAT16) is torch.float16
    with pytest.raises(ValueError, match="unsupported KV dtype 'int8'"):
        dtype_from_name("int8")


# ---- size_pool -------------------------------------------------------------------------


def test_cuda_budget_with_memory_fraction_and_headroom():
    # 80 GiB × 0.9 = 72 GiB; 16 GiB in use after warmup → budget 56 GiB = 57,344 MiB;
    # × 0.95 = 54,476.8 MiB; / 2 MiB = 27,238.4 → 27,238 blocks.
    report = size_pool(LLAMA3_8B, memory_total=80 * GiB, memory_free=64 * GiB, memory_fraction=0.9,
                       headroom=0.05, workspace_bytes=GiB, max_model_len=8192)
    assert report.bytes_per_block == 2 * MiB
    assert report.budget_bytes == 56 * GiB
    assert report.num_blocks == 27_238
    assert report.max_total_tokens == 27_238 * 16 == 435_808
    assert report.pool_bytes == 27_238 * 2 * MiB
    assert report.limited_by == "memory_fraction"
    assert report.max_full_length_sequences == pytest.approx(435_808 / 8192)
    assert (report.num_layers, report.num_kv_heads, report.head_dim, report.dtype_bytes) == (32, 8, 128, 2)
    assert (report.device, report.dtype, report.workspace_bytes) == ("cuda", "bfloat16", GiB)
    text = "\n".join(report.explanation)
    assert ("bytes_per_block = 2 (K and V) × 32 layers × 16 tokens × 8 KV heads × 128 head_dim × "
            "2 bytes (bfloat16) = 2.00 MiB") in text
    assert "80.00 GiB × 0.9 memory_fraction − 16.00 GiB in use after warmup" in text
    assert "= 56.00 GiB" in text
    assert "num_blocks = floor(budget × (1 − 0.05 headroom) / bytes_per_block)" in text
    assert "27,238" in text
    assert "max_total_tokens = num_blocks × block_size = 435,808 tokens" in text
    assert "a sequence of max_model_len 8,192 tokens needs 512 blocks; 53 such sequences fit at once" in text


def test_cpu_budget_is_kv_cache_bytes():
    # 64 MiB × 0.95 = 62,259.2 KiB; / 64 KiB = 972.8 → 972 blocks.
    report = size_pool(TINY_CPU, memory_total=8 * GiB, memory_free=4 * GiB, max_model_len=2048,
                       kv_cache_bytes=parse_bytes("64MiB"))
    assert report.bytes_per_block == 64 * KiB
    assert report.budget_bytes == 64 * MiB
    assert report.num_blocks == 972
    assert report.max_total_tokens == 15_552
    assert report.limited_by == "kv_cache_bytes"
    assert report.max_full_length_sequences == pytest.approx(15_552 / 2048)
    assert any("kv_cache_bytes = 64.00 MiB" in line for line in report.explanation)


def test_cpu_budget_is_a_fraction_of_available_ram():
    # 10 GiB available × 0.5 = 5 GiB, no headroom: 5 GiB / 64 KiB = 81,920 blocks.
    report = size_pool(TINY_CPU, memory_total=16 * GiB, memory_free=10 * GiB, memory_fraction=0.5,
                       headroom=0.0, max_model_len=2048)
    assert report.budget_bytes == 5 * GiB
    assert report.num_blocks == 81_920
    assert report.limited_by == "memory_fraction"


def test_max_blocks_caps_the_pool():
    report = size_pool(TINY_CPU, memory_total=8 * GiB, memory_free=4 * GiB, max_model_len=1024,
                       kv_cache_bytes=64 * MiB, max_blocks=100)
    assert report.num_blocks == 100
    assert report.max_total_tokens == 1600
    assert report.pool_bytes == 100 * 64 * KiB
    assert report.limited_by == "max_blocks"
    assert "capped at max_blocks = 100" in "\n".join(report.explanation)
    # A cap above what fits changes nothing.
    report = size_pool(TINY_CPU, memory_total=8 * GiB, memory_free=4 * GiB, max_model_len=1024,
                       kv_cache_bytes=64 * MiB, max_blocks=10_000)
    assert (report.num_blocks, report.limited_by) == (972, "kv_cache_bytes")


def test_kv_cache_bytes_caps_a_cuda_budget_only_when_smaller():
    small = size_pool(LLAMA3_8B, memory_total=80 * GiB, memory_free=64 * GiB, headroom=0.0,
                      max_model_len=8192, kv_cache_bytes=10 * GiB)
    assert (small.budget_bytes, small.num_blocks, small.limited_by) == (10 * GiB, 5120, "kv_cache_bytes")
    large = size_pool(LLAMA3_8B, memory_total=80 * GiB, memory_free=64 * GiB, headroom=0.0,
                      max_model_len=8192, kv_cache_bytes=100 * GiB)
    assert (large.budget_bytes, large.limited_by) == (56 * GiB, "memory_fraction")


def test_budget_too_small_for_one_block_names_the_numbers():
    # 16 GiB × 0.9 = 14.4 GiB, 15 GiB already in use: the budget is negative.
    with pytest.raises(SizingError) as caught:
        size_pool(LLAMA3_8B, memory_total=16 * GiB, memory_free=1 * GiB, max_model_len=8192)
    message = str(caught.value)
    assert "too small for one block" in message
    assert "-614.40 MiB" in message and "2,097,152 bytes" in message
    assert "--memory-fraction" in message
    # CPU: 100 KiB × 0.95 < 64 KiB? No: 95 KiB holds one block; 60 KiB does not.
    with pytest.raises(SizingError, match=r"budget 60.00 KiB \(61,440 bytes\).*65,536 bytes.*--kv-cache-bytes"):
        size_pool(TINY_CPU, memory_total=GiB, memory_free=GiB, max_model_len=16, kv_cache_bytes=60 * KiB)
    assert isinstance(caught.value, ValueError)


def test_pool_that_cannot_hold_one_full_length_sequence():
    # 16 MiB × 0.95 / 64 KiB = 243 blocks < 2048 tokens / 16 = 128? No: that fits; 8192 tokens needs 512.
    with pytest.raises(SizingError) as caught:
        size_pool(TINY_CPU, memory_total=GiB, memory_free=GiB, max_model_len=8192, kv_cache_bytes=16 * MiB)
    message = str(caught.value)
    assert "max_model_len 8,192" in message
    assert "needs 512 blocks" in message and "num_blocks is 243" in message
    assert "--kv-cache-bytes" in message and "--max-model-len" in message
    with pytest.raises(SizingError, match="needs 4 blocks.*num_blocks is 3.*--max-blocks"):
        size_pool(TINY_CPU, memory_total=GiB, memory_free=GiB, max_model_len=64, kv_cache_bytes=16 * MiB,
                  max_blocks=3)
    # Exactly one full-length sequence is enough.
    report = size_pool(TINY_CPU, memory_total=GiB, memory_free=GiB, max_model_len=49, kv_cache_bytes=16 * MiB,
                       max_blocks=4)
    assert report.num_blocks == 4


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 0},
        {"memory_free": 2 * GiB},
        {"memory_total": -1},
        {"memory_fraction": 0.0},
        {"memory_fraction": 1.5},
        {"headroom": 1.0},
        {"headroom": -0.1},
        {"workspace_bytes": -1},
        {"max_model_len": 0},
        {"kv_cache_bytes": 0},
        {"max_blocks": 0},
    ],
)
def test_size_pool_rejects_out_of_range_inputs(change):
    values = {"memory_total": GiB, "memory_free": GiB // 2, "max_model_len": 64, **change}
    with pytest.raises(ValueError):
        size_pool(TINY_CPU, **values)


def test_report_matches_the_proto_and_round_trips():
    report = size_pool(LLAMA3_8B, memory_total=80 * GiB, memory_free=64 * GiB, max_model_len=8192)
    proto_fields = [field.name for field in cache_pb2.SizingReport.DESCRIPTOR.fields]
    assert list(SizingReport.__dataclass_fields__) == proto_fields
    proto = wire.sizing_to_proto(report)
    assert proto.dtype == cache_pb2.DTYPE_BFLOAT16
    assert proto.num_blocks == report.num_blocks and list(proto.explanation) == report.explanation
    assert wire.sizing_from_proto(cache_pb2.SizingReport.FromString(proto.SerializeToString())) == report
    assert json.loads(json.dumps(report.to_dict()))["limited_by"] == "memory_fraction"


def test_weights_bytes_are_reported_by_type_and_never_subtracted():
    """The model service's weights as held (AttachRequest.weights_bytes_by_type): a term of
    the report and a sentence of its explanation, the budget as without them (free memory
    was measured after they loaded); on CUDA the in-use sentence names them."""
    held = {"Q4_1": 70 * MiB, "Q8_0": 27 * MiB, "float32": MiB}
    for geometry, memory in ((TINY_CPU, dict(memory_total=8 * GiB, memory_free=4 * GiB)),
                             (LLAMA3_8B, dict(memory_total=80 * GiB, memory_free=64 * GiB))):
        plain = size_pool(geometry, max_model_len=64, **memory)
        report = size_pool(geometry, max_model_len=64, weights_bytes=98 * MiB, weights_bytes_by_type=held, **memory)
        assert (report.budget_bytes, report.num_blocks) == (plain.budget_bytes, plain.num_blocks)
        assert (report.weights_bytes, report.weights_bytes_by_type) == (98 * MiB, held)
        assert report.explanation[1] == ("weights_bytes = 98.00 MiB as the model service holds them (Q4_1 70.00 MiB, "
                                         "Q8_0 27.00 MiB, float32 1.00 MiB): loaded before free memory was measured, "
                                         "so not subtracted again")
        sent = wire.sizing_to_proto(report).SerializeToString()
        assert wire.sizing_from_proto(cache_pb2.SizingReport.FromString(sent)) == report
        assert any(line.split()[:2] == ["weights_bytes", f"{98 * MiB:,}"] for line in report.format_table().splitlines())
    assert "in use after warmup (weights 98.00 MiB, 0 B workspace" in report.explanation[2]
    with pytest.raises(ValueError, match="weights_bytes cannot be negative"):
        size_pool(TINY_CPU, memory_total=GiB, memory_free=GiB, max_model_len=64, weights_bytes=-1)


def test_measure_cpu_memory():
    total, free = measure_device_memory("cpu")
    assert 0 < free <= total


def test_read_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")
    assert _read_meminfo(str(meminfo)) == (16 * MiB, 8 * MiB)


# ---- the offline calculator -------------------------------------------------------------


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    return path


def test_weight_estimate_of_llama3_8b():
    assert sizing_cli.estimate_parameters(LLAMA3_8B_CONFIG) == LLAMA3_8B_PARAMETERS
    tied = {**LLAMA3_8B_CONFIG, "tie_word_embeddings": True}
    assert sizing_cli.estimate_parameters(tied) == LLAMA3_8B_PARAMETERS - 128256 * 4096


def test_cli_text(llama_config, capsys):
    # weights 8,030,261,248 × 2 bytes; budget = 80 GiB × 0.9 − weights − 1 GiB workspace.
    assert sizing_cli.main(["--config", str(llama_config), "--memory", "80GiB", "--dtype", "bfloat16",
                            "--workspace-bytes", "1GiB"]) == 0
    out = capsys.readouterr().out
    budget = 72 * GiB - 2 * LLAMA3_8B_PARAMETERS - GiB
    num_blocks = int(budget * 0.95) // (2 * MiB)
    assert num_blocks == 27_259
    lines = out.splitlines()
    assert any(line.split()[:2] == ["bytes_per_block", "2,097,152"] for line in lines)
    assert any(line.split()[:2] == ["num_blocks", "27,259"] for line in lines)
    assert any(line.split()[:2] == ["max_total_tokens", f"{27_259 * 16:,}"] for line in lines)
    assert any(line.split()[:2] == ["limited_by", "memory_fraction"] for line in lines)
    assert "weights ≈ 14.96 GiB: an estimate from config.json (8,030,261,248 parameters × 2 bytes)" in out
    assert "num_blocks = floor(budget × (1 − 0.05 headroom) / bytes_per_block)" in out
    # The table's values line up in one column.
    table = lines[: lines.index("")]
    assert len({line.index(line.split()[1]) + len(line.split()[1]) for line in table}) == 1


def test_cli_json(llama_config, capsys):
    assert sizing_cli.main(["--config", str(llama_config.parent), "--memory", "80GiB", "--weights-bytes", "16GiB",
                            "--max-model-len", "4096", "--block-size", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == list(SizingReport.__dataclass_fields__)
    # 72 GiB − 16 GiB = 56 GiB; × 0.95 / 4 MiB = 13,619.2.
    assert report["bytes_per_block"] == 4 * MiB
    assert report["budget_bytes"] == 56 * GiB
    assert report["num_blocks"] == 13_619
    assert report["max_model_len"] == 4096
    assert report["dtype"] == "bfloat16"
    assert report["explanation"][0] == "weights = 16.00 GiB (--weights-bytes)"
    assert report["weights_bytes"] == 16 * GiB


def test_cli_cpu_kv_cache_bytes(llama_config, capsys):
    assert sizing_cli.main(["--config", str(llama_config), "--memory", "64GiB", "--device", "cpu",
                            "--kv-cache-bytes", "2GiB", "--dtype", "float32", "--max-model-len", "4096", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_per_block"] == 4 * MiB
    assert report["num_blocks"] == int(2 * GiB * 0.95) // (4 * MiB) == 486
    assert report["limited_by"] == "kv_cache_bytes"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory", "16GiB"], "too small for one block"),
        (["--memory", "8GiB"], "exceed --memory"),
        (["--memory", "16GiB", "--memory-fraction", "1"], "needs 512 blocks"),
        (["--memory", "80GiB", "--dtype", "int4"], "unsupported KV dtype"),
        (["--memory", "80GiB", "--weights-bytes", "lots"], "not a byte quantity"),
        (["--memory", "80GiB", "--headroom", "2"], "headroom"),
    ],
)
def test_cli_errors_exit_2(llama_config, capsys, argv, message):
    assert sizing_cli.main(["--config", str(llama_config), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_bad_config_and_flags(tmp_path, capsys):
    assert sizing_cli.main(["--config", str(tmp_path / "missing.json"), "--memory", "80GiB"]) == 2
    assert "no config file" in capsys.readouterr().err
    broken = tmp_path / "config.json"
    broken.write_text(json.dumps({"num_hidden_layers": 2}))
    assert sizing_cli.main(["--config", str(broken), "--memory", "80GiB"]) == 2
    assert "num_attention_heads" in capsys.readouterr().err
    assert sizing_cli.main(["--config", str(broken), "--memory", "eighty"]) == 2
    assert "--memory" in capsys.readouterr().err


def test_python_m_cache_service_sizing(llama_config):
    if not (REPO / "cache_service" / "__main__.py").exists():
        pytest.skip("cache_service/__main__.py does not exist yet")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "cache_service", "sizing", "--config", str(llama_config), "--memory", "80GiB",
               "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bytes_per_block"] == 2 * MiB
    too_small = subprocess.run(command[:-2] + ["16GiB"], capture_output=True, text=True, env=env, cwd=REPO,
                               timeout=120)
    assert too_small.returncode == 2
    assert "too small for one block" in too_small.stderr


# ---- fp8 KV (--kv-cache-dtype) ------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_block_is_half_a_bfloat16_block_and_the_pool_holds_twice_the_tokens(name):
    bf16 = LLAMA3_8B
    fp8 = KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype=dtype_from_name(name), device="cuda")
    assert fp8.bytes_per_block(16) * 2 == bf16.bytes_per_block(16) == 2 * MiB
    terms = dict(memory_total=80 * GiB, memory_free=60 * GiB, max_model_len=8192, headroom=0.0)
    wide, narrow = size_pool(bf16, **terms), size_pool(fp8, **terms)
    assert narrow.budget_bytes == wide.budget_bytes
    assert narrow.num_blocks == 2 * wide.num_blocks and narrow.max_total_tokens == 2 * wide.max_total_tokens
    assert narrow.dtype == name and narrow.dtype_bytes == 1
    assert f"1 bytes ({name})" in narrow.explanation[0]
    assert any(line.startswith(f"KV cache dtype {name}:") for line in narrow.explanation)
    assert wire.sizing_from_proto(wire.sizing_to_proto(narrow)) == narrow


def test_fp8_dtype_names_and_protos():
    assert dtype_from_name("fp8") is torch.float8_e4m3fn  # vLLM's --kv-cache-dtype fp8
    assert dtype_from_name("FP8_E5M2") is torch.float8_e5m2
    assert dtype_name(torch.float8_e4m3fn) == "fp8_e4m3"
    assert dtype_from_proto(cache_pb2.DTYPE_FLOAT8_E5M2) is torch.float8_e5m2
    geometry = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float8_e4m3fn, device="cpu")
    assert KvGeometry.from_proto(geometry.to_proto()) == geometry


def test_cli_kv_cache_dtype_halves_the_block_and_keeps_the_weights(llama_config, capsys):
    argv = ["--config", str(llama_config), "--memory", "80GiB", "--dtype", "bfloat16", "--json"]
    assert sizing_cli.main(argv) == 0
    wide = json.loads(capsys.readouterr().out)
    assert sizing_cli.main([*argv, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    narrow = json.loads(capsys.readouterr().out)
    assert (narrow["dtype"], narrow["dtype_bytes"], narrow["bytes_per_block"]) == ("fp8_e4m3", 1, MiB)
    assert narrow["budget_bytes"] == wide["budget_bytes"]  # weights still 2 bytes a parameter
    assert narrow["num_blocks"] in (2 * wide["num_blocks"], 2 * wide["num_blocks"] + 1)
    assert sizing_cli.main([*argv, "--kv-cache-dtype", "int4"]) == 2
    assert "unsupported KV dtype 'int4'" in capsys.readouterr().err


# ---- the cache service's --kv-cache-bytes on CUDA -------------------------------------


class _Sized(Exception):
    """Stops KvPool._create after sizing: allocating a CUDA pool needs a GPU."""


def test_kv_cache_bytes_reaches_the_cuda_pool_through_the_cache_service(monkeypatch):
    # The flag as the cache service parses it (docker-compose.gpu.yml's 256MiB), through
    # serve's settings and KvPool's Attach path to size_pool, with the CUDA memory query
    # faked: an 80 GiB device with 64 GiB free would otherwise give the pool ~50 GiB.
    from cache_service.core import pool as pool_module
    from cache_service.api import server

    args = server.build_parser().parse_args(["--kv-cache-bytes", "256MiB"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 * GiB, 80 * GiB))
    received = {}

    def spy(geometry, **kwargs):
        received.update(kwargs, report=size_pool(geometry, **kwargs))
        raise _Sized

    monkeypatch.setattr(pool_module, "size_pool", spy)
    pool = pool_module.KvPool(server.pool_settings(args))
    with pytest.raises(_Sized):
        pool.attach("model", LLAMA3_8B, workspace_bytes=GiB, max_model_len=1024)
    assert (received["memory_total"], received["memory_free"]) == (80 * GiB, 64 * GiB)
    assert received["kv_cache_bytes"] == 256 * MiB
    report = received["report"]
    assert report.limited_by == "kv_cache_bytes" and report.pool_bytes <= 256 * MiB
    assert report.num_blocks == 121  # floor(256 MiB × 0.95 / 2 MiB)


# ---- LoRA adapter slots -----------------------------------------------------------------

# Llama-3-8B, rank 64 on all seven projections of 32 layers in bfloat16: 64 × 81,920 × 32 × 2 bytes.
LORA_8B_RANK64 = 320 * MiB


def test_lora_slots_not_loaded_leave_a_measured_budget():
    report = size_pool(LLAMA3_8B, memory_total=80 * GiB, memory_free=64 * GiB, memory_fraction=0.9,
                       max_model_len=8192, lora_slot_bytes=4 * LORA_8B_RANK64, lora_resident_bytes=LORA_8B_RANK64)
    # The loaded adapter is in the 16 GiB in use already; the three slots still empty are kept out.
    assert report.budget_bytes == 56 * GiB - 3 * LORA_8B_RANK64
    assert (report.lora_slot_bytes, report.lora_resident_bytes) == (4 * LORA_8B_RANK64, LORA_8B_RANK64)
    assert any("lora_slot_bytes = 1.25 GiB" in line for line in report.explanation)
    assert "lora_slot_bytes" in report.format_table()
    cpu = size_pool(TINY_CPU, memory_total=8 * GiB, memory_free=4 * GiB, memory_fraction=0.5, max_model_len=1024,
                    lora_slot_bytes=MiB)
    assert cpu.budget_bytes == 2 * GiB - MiB
    given = size_pool(TINY_CPU, memory_total=8 * GiB, memory_free=4 * GiB, max_model_len=1024,
                      kv_cache_bytes=64 * MiB, lora_slot_bytes=MiB)
    assert given.budget_bytes == 64 * MiB  # --kv-cache-bytes is the pool's own budget
    assert wire.sizing_from_proto(wire.sizing_to_proto(report)) == report


def test_lora_resident_past_its_slots_refused():
    with pytest.raises(ValueError, match="lora_resident_bytes"):
        size_pool(TINY_CPU, memory_total=8 * GiB, memory_free=4 * GiB, max_model_len=1024,
                  lora_slot_bytes=MiB, lora_resident_bytes=2 * MiB)


def test_cli_lora_slots(llama_config, capsys):
    assert sizing_cli.main(["--config", str(llama_config), "--memory", "80GiB", "--weights-bytes", "16GiB",
                            "--max-model-len", "4096", "--max-loras", "4", "--max-lora-rank", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lora_slot_bytes"] == 4 * LORA_8B_RANK64
    assert report["budget_bytes"] == 56 * GiB - 4 * LORA_8B_RANK64
    assert sizing_cli.main(["--config", str(llama_config), "--memory", "80GiB", "--max-loras", "2"]) == 0
    assert "lora_slot_bytes" in capsys.readouterr().out
    assert sizing_cli.main(["--config", str(llama_config), "--memory", "80GiB", "--max-lora-rank", "100000",
                            "--max-loras", "1"]) == 2
    assert "--max-lora-rank" in capsys.readouterr().err
