"""PEFT adapters loaded at start (model_service/lora/): what a good adapter gives, and every
kind of bad one refused with its reason and nothing of it kept."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_service.loading.tiny import tiny_config
from model_service.lora.peft_adapter import MAX_HEADER_BYTES, WEIGHTS_FILE, AdapterError, load_adapter
from model_service.lora.registry import LoraRegistry, parse_lora_module
from lora_adapters import hf_llama_of, write_adapter

pytest.importorskip("peft")
CONFIG = tiny_config()


@pytest.fixture(scope="module")
def base():
    return hf_llama_of(CONFIG)


@pytest.fixture(scope="module")
def adapter_dir(base, tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("good") / "a", base, rank=8, alpha=16)


@pytest.fixture
def broken(adapter_dir, tmp_path):
    """A fresh copy of the good adapter, for a test to damage."""
    return shutil.copytree(adapter_dir, tmp_path / "broken")


def edit_config(directory, **fields):
    path = directory / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))


def refused(directory, match, max_rank=64):
    with pytest.raises(AdapterError, match=match):
        load_adapter("x", directory, CONFIG, max_rank=max_rank)


def test_factors_and_scaling_are_peft_s(adapter_dir):
    adapter = load_adapter("a", adapter_dir, CONFIG, max_rank=64)
    saved = load_file(str(adapter_dir / WEIGHTS_FILE))
    assert adapter.rank == 8 and adapter.scaling == 16 / 8
    assert adapter.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert len(adapter.weights) == 7 * CONFIG.num_layers
    a = saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = saved["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(1, "down_proj")].a, a) and torch.equal(adapter.weights[(1, "down_proj")].b, b)
    assert b.abs().sum() > 0  # the test adapter is not peft's zero-initialised no-op
    assert adapter.nbytes == sum(t.numel() * 4 for t in saved.values())


def test_rslora_scales_by_the_root_of_the_rank(base, tmp_path):
    adapter = load_adapter("r", write_adapter(tmp_path / "r", base, rank=16, alpha=8, use_rslora=True,
                                              targets=["q_proj", "v_proj"]), CONFIG, max_rank=64)
    assert adapter.scaling == pytest.approx(8 / math.sqrt(16))
    assert adapter.targets == ("q_proj", "v_proj")


def test_identity_is_the_weights_not_the_name_or_path(base, adapter_dir, tmp_path):
    first = load_adapter("a", adapter_dir, CONFIG, max_rank=64)
    again = load_adapter("b", shutil.copytree(adapter_dir, tmp_path / "copy"), CONFIG, max_rank=64)
    other = load_adapter("a", write_adapter(tmp_path / "other", base, seed=1), CONFIG, max_rank=64)
    assert first.digest == again.digest != other.digest
    edit_config(tmp_path / "copy", lora_alpha=32)  # the same factors scaled otherwise write other K/V
    assert load_adapter("b", tmp_path / "copy", CONFIG, max_rank=64).digest != first.digest


def test_wrong_base_shapes_refused(tmp_path):
    from dataclasses import replace
    other = hf_llama_of(replace(CONFIG, hidden_size=32, head_dim=8))
    refused(write_adapter(tmp_path / "w", other), r"shape .* trained on another base")


def test_more_layers_than_the_base_refused(tmp_path):
    from dataclasses import replace
    refused(write_adapter(tmp_path / "deep", hf_llama_of(replace(CONFIG, num_layers=3))), "layer 2.*2 layers")


def test_unknown_targets_refused(broken):
    edit_config(broken, target_modules=["q_proj", "lm_head"])
    refused(broken, r"\['lm_head'\] are not served")


def test_tensor_of_an_unserved_module_refused(broken):
    tensors = load_file(str(broken / WEIGHTS_FILE))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(broken / WEIGHTS_FILE))
    refused(broken, "lm_head.*not a LoRA factor of a served projection")


def test_truncated_file_refused(broken):
    path = broken / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(broken, "truncated or corrupt")
    path.write_bytes(b"\x10\x00")
    refused(broken, "truncated")


def test_rank_over_the_limit_refused(adapter_dir, broken):
    refused(adapter_dir, r"rank 8 is over --max-lora-rank 4", max_rank=4)
    edit_config(broken, r=10**12)  # a config's rank is checked before any tensor is read
    refused(broken, "over --max-lora-rank")


def test_missing_or_bad_config_refused(broken, tmp_path):
    (broken / "adapter_config.json").unlink()
    refused(broken, "adapter_config.json is missing")
    (broken / "adapter_config.json").write_text("{not json")
    refused(broken, "not valid JSON")
    (broken / "adapter_config.json").write_text(" " * (2 << 20))
    refused(broken, "more than a config holds")
    refused(tmp_path / "nowhere", "not a directory")


@pytest.mark.parametrize("fields, match", [
    ({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias 'all'"), ({"peft_type": "IA3"}, "only LORA"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"lora_alpha": float("nan")}, "lora_alpha"), ({"r": "8"}, "field r"), ({"target_modules": []}, "target_modules"),
])
def test_unserved_config_features_refused(broken, fields, match):
    edit_config(broken, **fields)
    refused(broken, match)


def test_pickled_weights_never_loaded(broken):
    (broken / WEIGHTS_FILE).rename(broken / "adapter_model.bin")
    refused(broken, "pickle, which is never loaded")


def test_config_paths_are_never_followed(broken, tmp_path):
    # The base it names (and any path in it) is not read: shapes are checked against the served base.
    edit_config(broken, base_model_name_or_path="../../../../etc/shadow")
    assert load_adapter("x", broken, CONFIG, max_rank=64).rank == 8


def test_giant_or_malformed_header_refused(broken):
    path = broken / WEIGHTS_FILE
    path.write_bytes((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}")
    refused(broken, "header")
    path.write_bytes((1 << 62).to_bytes(8, "little"))
    refused(broken, "header")
    path.write_bytes((12).to_bytes(8, "little") + b'{"a": [1, 2' + b"\x00")
    refused(broken, "truncated or corrupt")


def test_oversized_payload_refused_before_reading(broken):
    path = broken / WEIGHTS_FILE
    with open(path, "ab") as file:
        file.truncate(path.stat().st_size + (64 << 20))
    refused(broken, "more than an adapter of --max-lora-rank")


def test_non_finite_factors_refused(broken):
    tensors = load_file(str(broken / WEIGHTS_FILE))
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(broken / WEIGHTS_FILE))
    refused(broken, "NaN or infinite")


def test_a_factor_without_its_pair_refused(broken):
    tensors = load_file(str(broken / WEIGHTS_FILE))
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, str(broken / WEIGHTS_FILE))
    refused(broken, "layer 0 q_proj has no lora_B")


def test_registry_is_all_or_none(adapter_dir, broken):
    (broken / WEIGHTS_FILE).write_bytes(b"")
    registry = LoraRegistry(CONFIG, max_loras=4, base_name="tiny")
    with pytest.raises(AdapterError, match="'bad'"):
        registry.load_all([f"good={adapter_dir}", f"bad={broken}"])
    assert len(registry) == 0
    with pytest.raises(AdapterError, match="more than --max-loras 1"):
        LoraRegistry(CONFIG, max_loras=1).load_all([f"a={adapter_dir}", f"b={adapter_dir}"])
    with pytest.raises(AdapterError, match="more than once"):
        registry.load_all([f"a={adapter_dir}", f"a={adapter_dir}"])
    with pytest.raises(AdapterError, match="base model's"):
        registry.load_all([f"tiny={adapter_dir}"])
    registry.load_all([f"a={adapter_dir}", f"b={adapter_dir}"])
    assert registry.get("a").digest == registry.get("b").digest and len(registry) == 2
    with pytest.raises(AdapterError, match="has already been loaded"):
        registry.load_all([f"a={adapter_dir}"])


@pytest.mark.parametrize("text", ["noequals", "=path", "name=", " spaced=x", "a" * 129 + "=x"])
def test_module_flag_form_checked(text):
    with pytest.raises(AdapterError, match="--lora-modules"):
        parse_lora_module(text)


def test_flag_limits_checked():
    with pytest.raises(ValueError, match="--max-lora-rank"):
        LoraRegistry(CONFIG, max_rank=100000)
    with pytest.raises(ValueError, match="--max-loras"):
        LoraRegistry(CONFIG, max_loras=-1)


def test_server_start_stops_on_a_bad_adapter(broken, tmp_path):
    """The real `python -m model_service` refuses to start, with the adapter's reason, before
    it contacts the cache service (none runs here)."""
    edit_config(broken, target_modules=["embed_tokens"])
    result = subprocess.run(
        [sys.executable, "-m", "model_service", "--model", "tiny", "--http-port", "-1", "--port", "0",
         "--metrics-port", "0", "--cache-service", "127.0.0.1:9", "--lora-modules", f"bad={broken}"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "['embed_tokens'] are not served" in result.stdout + result.stderr


def test_an_unloaded_adapter_in_use_keeps_its_slot_until_released(adapter_dir):
    registry = LoraRegistry(CONFIG, max_loras=2, runtime=True)
    assert registry.slot_bytes(torch.float32) > 0  # runtime loading keeps the slots before any load
    registry.load_all([f"a={adapter_dir}"])
    registry.reserve("b")
    with pytest.raises(AdapterError, match="has already been loaded"):
        registry.reserve("b")  # being loaded counts as loaded
    with pytest.raises(AdapterError, match="more than --max-loras 2"):
        registry.reserve("c")
    registry.unreserve("b")
    held = registry.acquire("a")
    assert registry.unload("a") is held and registry.get("a") is None
    assert registry.resident_bytes() == held.nbytes and registry.slots_used() == 1
    registry.load_all([f"b={adapter_dir}"])
    with pytest.raises(AdapterError, match="still used by running requests"):
        registry.reserve("c")
    registry.release(held)
    assert registry.resident_bytes() == registry.get("b").nbytes
    registry.reserve("c")
    assert registry.unload("nobody") is None
