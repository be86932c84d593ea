"""Loading checkpoints and the tiny model, and every error a user can reach while loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from harness.hf_checkpoints import EOS_ID, EXTRA_ID, MISTRAL_WINDOW, QWEN2_WINDOW, write_checkpoint
from model_service.attention.metadata import AttentionMetadata
from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.loading.loader import load_model
from model_service.models.rope import inverse_frequencies
from model_service.loading.tiny import build_tiny_model, tiny_config
from model_service.text.tokenizer import ByteTokenizer, HFTokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: write_checkpoint(kind, root / kind) for kind in ("llama", "llama-sharded", "qwen2", "mistral")}


@pytest.fixture
def llama_copy(checkpoints, tmp_path):
    return shutil.copytree(checkpoints["llama"], tmp_path / "llama")


def edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_sharded_checkpoint_loads_same_weights_as_single_file(checkpoints):
    assert (checkpoints["llama-sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(checkpoints["llama-sharded"].glob("model-*.safetensors"))) > 2
    single = load_model(str(checkpoints["llama"])).model.state_dict()
    sharded = load_model(str(checkpoints["llama-sharded"])).model.state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def dense(linear) -> torch.Tensor:
    """A linear's plain weight: a CPU float32 model's layer linears may hold panels
    (models/panel_linear.py), which give it back by dense_weight()."""
    return linear.dense_weight() if hasattr(linear, "dense_weight") else linear.weight


def test_fused_layout_holds_hf_tensors_in_order(checkpoints):
    tensors = load_file(checkpoints["qwen2"] / "model.safetensors")
    model = load_model(str(checkpoints["qwen2"])).model
    attn = "model.layers.1.self_attn"
    expected_qkv = torch.cat([tensors[f"{attn}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(dense(model.layers[1].self_attn.qkv_proj), expected_qkv)
    expected_bias = torch.cat([tensors[f"{attn}.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(model.layers[1].self_attn.qkv_proj.bias, expected_bias)
    mlp = "model.layers.1.mlp"
    expected_gate_up = torch.cat([tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]])
    assert torch.equal(dense(model.layers[1].mlp.gate_up_proj), expected_gate_up)
    assert model.layers[1].self_attn.o_proj.bias is None


def test_tied_embeddings_share_one_tensor(checkpoints):
    tensors = load_file(checkpoints["qwen2"] / "model.safetensors")
    assert "lm_head.weight" not in tensors
    loaded = load_model(str(checkpoints["qwen2"]))
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_config_fields_from_checkpoints(checkpoints):
    llama = ModelConfig.from_hf_dir(checkpoints["llama"])
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert llama.rope_scaling["rope_type"] == "llama3"
    assert llama.eos_token_ids == (EOS_ID, EXTRA_ID)  # generation_config.json: a list
    qwen2 = ModelConfig.from_hf_dir(checkpoints["qwen2"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings
    assert qwen2.eos_token_ids == (EOS_ID,)  # generation_config.json: an int
    assert ModelConfig.from_hf_dir(checkpoints["mistral"]).head_dim == 32  # != hidden / heads


def test_legacy_rope_scaling_spelling():
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    }
    config = ModelConfig.from_hf_dict(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0
    assert ModelConfig.from_hf_dict({**raw, "rope_scaling": None}).rope_scaling is None


def test_llama3_rope_frequencies_match_transformers(checkpoints):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(checkpoints["llama"])
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inverse_frequencies(ModelConfig.from_hf_dir(checkpoints["llama"]))
    assert torch.equal(ours, expected)


def test_sliding_window_is_read_as_transformers_applies_it(checkpoints):
    with capture_logs() as logs:
        mistral = ModelConfig.from_hf_dir(checkpoints["mistral"])
    assert mistral.sliding_window == MISTRAL_WINDOW and mistral.sliding_window_layers is None
    assert [mistral.window_of(i) for i in range(mistral.num_layers)] == [MISTRAL_WINDOW] * mistral.num_layers
    assert any(entry["event"] == "sliding window attention" for entry in logs)

    raw = json.loads((checkpoints["mistral"] / "config.json").read_text())
    assert ModelConfig.from_hf_dict({**raw, "sliding_window": None}).window_of(0) is None
    qwen2 = {**raw, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 6, "num_hidden_layers": 4}
    # Qwen2 ignores the window unless use_sliding_window; then layers >= max_window_layers slide.
    assert ModelConfig.from_hf_dict(qwen2).sliding_window is None
    windowed = ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": True, "max_window_layers": 1})
    assert [windowed.window_of(i) for i in range(4)] == [None, 6, 6, 6]
    assert ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": True, "max_window_layers": 4}).sliding_window is None
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    by_type = ModelConfig.from_hf_dict({**qwen2, "use_sliding_window": True, "layer_types": types})
    assert [by_type.window_of(i) for i in range(4)] == [6, None, 6, None]
    # Llama has no sliding window, whatever its config says.
    assert ModelConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"]}).sliding_window is None
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_hf_dict({**raw, "sliding_window": 0})
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_hf_dict({**raw, "sliding_window": "4096"})


def test_qwen2_window_config_matches_transformers_layer_types(checkpoints, tmp_path):
    from transformers import AutoConfig

    path = write_checkpoint("qwen2-window", tmp_path / "qwen2-window")
    hf = AutoConfig.from_pretrained(path)
    ours = ModelConfig.from_hf_dir(path)
    expected = [hf.sliding_window if kind == "sliding_attention" else None for kind in hf.layer_types]
    assert [ours.window_of(i) for i in range(ours.num_layers)] == expected == [None, QWEN2_WINDOW]


def test_bfloat16_load(checkpoints):
    loaded = load_model(str(checkpoints["llama"]), torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.rotary.cos_cache.dtype == torch.bfloat16
    config = loaded.config
    pool = torch.zeros((config.num_layers, 2, 4, 16, config.num_kv_heads, config.head_dim), dtype=torch.bfloat16)
    ids = loaded.tokenizer.encode("hello")
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(ids)) + 16, block_tables=torch.tensor([[1, 0]], dtype=torch.int32),
        context_lens=torch.tensor([len(ids)], dtype=torch.int32), query_lens=(len(ids),),
        context_lens_host=(len(ids),), num_decode_seqs=0, block_size=16,
    )
    with torch.inference_mode():
        logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), pool, meta))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_and_llama_shaped():
    config = tiny_config()
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (64, 2, 4, 2)
    assert config.vocab_size == ByteTokenizer().vocab_size
    first, second = build_tiny_model().state_dict(), build_tiny_model().state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    loaded = load_model("tiny")
    assert loaded.model_id == "tiny" and isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.config.eos_token_ids == loaded.tokenizer.eos_token_ids


# --- errors a user can reach ---


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="is not 'tiny', 'smollm2', a .gguf file or an existing checkpoint directory"):
        load_model(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("file_name", "message"),
    [("config.json", "missing config.json"), ("tokenizer.json", "missing tokenizer.json"),
     ("model.safetensors", "no weights")],
)
def test_missing_file(llama_copy, file_name, message):
    (llama_copy / file_name).unlink()
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(llama_copy))


def test_missing_shard(checkpoints, tmp_path):
    directory = shutil.copytree(checkpoints["llama-sharded"], tmp_path / "sharded")
    next(directory.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of"):
        load_model(str(directory))


def test_unsupported_architecture(llama_copy):
    edit_config(llama_copy, architectures=["GPTNeoXForCausalLM"])
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    with pytest.raises(ModelLoadError, match=f"GPTNeoXForCausalLM.*{supported}"):
        load_model(str(llama_copy))


def test_unsupported_rope_type(llama_copy):
    edit_config(llama_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope type 'yarn' unsupported"):
        load_model(str(llama_copy))


def test_missing_and_unexpected_tensors_are_named(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(ModelLoadError) as error:
        load_model(str(llama_copy))
    assert "missing tensors [model.layers.1.mlp.up_proj.weight]" in str(error.value)
    assert "unexpected tensors [model.layers.1.mlp.extra.weight]" in str(error.value)


def test_shape_mismatch(llama_copy):
    edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight.*shape \(128, 64\).*\(96, 64\)"):
        load_model(str(llama_copy))


def test_invalid_head_counts():
    with pytest.raises(ModelLoadError, match="multiple of num_kv_heads"):
        ModelConfig("LlamaForCausalLM", 10, 8, 16, 1, num_heads=3, num_kv_heads=2, head_dim=4)


def test_hf_tokenizer_loaded_with_checkpoint(checkpoints):
    loaded = load_model(str(checkpoints["llama"]))
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.eos_token_ids == (EOS_ID, EXTRA_ID)
