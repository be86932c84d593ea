"""GGUF checkpoints: files written by the test with gguf.GGUFWriter from a tiny random Llama.

pagedkv's paged forward pass (weights dequantized at load; test_quantized_model.py
compares the blocks held natively with that) and greedy tokens equal transformers' reading
the same file (`gguf_file=`), in F32, F16, Q8_0 and Q4_0; every file pagedkv cannot serve is a start-up
error that names what is wrong and what is supported.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_checkpoints import QUANT_TYPES, write_gguf
from test_model_vs_transformers import reference_logits

from harness.paged_runner import PagedRunner
from harness.processes import start_cache_service, start_model_service
from harness.reference_generate import reference_greedy
from model_service.errors import ModelLoadError
from model_service.loading.gguf_weights import unpermute_rope_rows
from model_service.loading.loader import load_model

PROMPT = "The quick brown fox jumps over the lazy dog. Grüße 🙂"
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=QUANT_TYPES)
def gguf_models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path, original = write_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", request.param)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, load_model(str(path), torch.float32, "cpu", weights="dequantize"), reference, original


def test_paged_forward_and_greedy_tokens_match_transformers(gguf_models):
    quant_type, loaded, reference, original = gguf_models
    prompt = loaded.tokenizer.encode(PROMPT)
    runner = PagedRunner(loaded.model, loaded.config)
    (logits,) = runner.step([("a", prompt)], num_decode_seqs=0)
    expected = reference_logits(reference, prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    if quant_type != "F32":  # the file's rounding is served, not the weights it was made from
        assert not torch.allclose(expected, reference_logits(original, prompt), atol=1e-4, rtol=1e-4)

    ours = [int(logits[-1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        (logits,) = runner.step([("a", [ours[-1]])], num_decode_seqs=1)
        ours.append(int(logits[-1].argmax()))
    assert ours == reference_greedy(reference, prompt, NEW_TOKENS)


def test_config_tokenizer_and_template_come_from_the_metadata(gguf_models):
    _, loaded, reference, _ = gguf_models
    config, hf = loaded.config, reference.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, 16)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert not config.tie_word_embeddings
    assert loaded.tokenizer.encode("hi")[0] == 1  # the file's add_bos_token
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(PROMPT)) == PROMPT
    assert loaded.chat_template.render([{"role": "user", "content": "hi"}]) == "<|extra|>user\nhi</s>\n<|extra|>assistant\n"


def test_unpermute_inverts_llama_cpp_permute():
    from gguf_checkpoints import permute

    weight = torch.randn(4 * 16, 8)
    restored = unpermute_rope_rows(torch.from_numpy(permute(weight.numpy(), 4)), 4)
    assert torch.equal(restored, weight)


def test_tied_embeddings_file(tmp_path):
    path, original = write_gguf(tmp_path / "tied.gguf", "F32", tie_word_embeddings=True)
    loaded = load_model(str(path), torch.float32, "cpu")
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_directory_with_one_gguf_file_loads(tmp_path):
    path, _ = write_gguf(tmp_path / "only" / "model.gguf", "F32")
    (path.parent / "model-tokenizer").rename(tmp_path / "tokenizer-files")  # leave the file alone
    assert load_model(str(path.parent), torch.float32, "cpu").config.num_layers == 2


# ---------------------------------------------------------------------------------------
# Files pagedkv cannot serve: one row each


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="bad.gguf is not a readable GGUF file: GGUF magic invalid"):
        load_model(str(bad), torch.float32, "cpu")


def test_truncated_gguf_file(tmp_path):
    path, _ = write_gguf(tmp_path / "whole.gguf", "F32")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    with pytest.raises(ModelLoadError, match="truncated.gguf is not a readable GGUF file"):
        load_model(str(truncated), torch.float32, "cpu")


def write_metadata_file(path, endianess, arrays):
    import gguf

    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    for key, values in arrays.items():
        writer.add_array(key, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


METADATA_ARRAYS = {"a.ints": [1, -2, 3], "a.floats": [1.5, -2.25], "a.bools": [True, False],
                   "a.strings": ["Grüße 🙂", "", "a b"], "a.empty": [], "a.nested": [[1, 2], [3]]}


@pytest.mark.parametrize("endianess", ["LITTLE", "BIG"])
def test_metadata_arrays_read_as_gguf_reads_them(tmp_path, endianess):
    """gguf_file.py reads arrays in the metadata itself (gguf's parse of SmolLM2's
    vocabulary makes numpy views per element, slow and large): every kind of array reads as
    gguf's reader reads it."""
    import gguf

    from model_service.loading.gguf_file import GGUFFile

    path = write_metadata_file(tmp_path / "arrays.gguf", gguf.GGUFEndian[endianess], METADATA_ARRAYS)
    fields = gguf.GGUFReader(path).fields
    assert {key: GGUFFile(path).value(key) for key in fields} == {key: field.contents() for key, field in fields.items()}
    assert GGUFFile(path).value("a.strings") == METADATA_ARRAYS["a.strings"]


@pytest.mark.parametrize("key", ["a.ints", "a.strings"])
def test_metadata_array_cut_short_is_a_load_error(tmp_path, key):
    import gguf

    path = write_metadata_file(tmp_path / "whole.gguf", gguf.GGUFEndian.LITTLE, {key: METADATA_ARRAYS[key]})
    field = gguf.GGUFReader(path).fields[key]
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: field.offset + sum(int(part.nbytes) for part in field.parts) - 2])
    with pytest.raises(ModelLoadError, match=rf"truncated.gguf is not a readable GGUF file: {key}: its 3 items run "
                                             "past the end of the file"):
        load_model(str(truncated), torch.float32, "cpu")


def test_unsupported_architecture(tmp_path):
    path, _ = write_gguf(tmp_path / "falcon.gguf", "F32", architecture="falcon")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'falcon' is unsupported; supported: llama"):
        load_model(str(path), torch.float32, "cpu")


def test_unsupported_tensor_type_is_named_with_the_supported_ones(tmp_path):
    as_f64 = {"blk.0.attn_v.weight": np.zeros((32, 64), dtype=np.float64)}
    path, _ = write_gguf(tmp_path / "f64.gguf", "F32", extra_tensors=as_f64)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_v\.weight \(F64\); supported: F32, F16, BF16, Q4_0"):
        load_model(str(path), torch.float32, "cpu")


def test_unsupported_tokenizer_model(tmp_path):
    path, _ = write_gguf(tmp_path / "spm.gguf", "F32", tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model 'llama' is unsupported; supported: gpt2"):
        load_model(str(path), torch.float32, "cpu")


def test_rope_frequency_factors_are_refused(tmp_path):
    path, _ = write_gguf(tmp_path / "rope.gguf", "F32", extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight: per-dimension RoPE frequency factors"):
        load_model(str(path), torch.float32, "cpu")


def test_unexpected_tensor_is_named(tmp_path):
    path, _ = write_gguf(tmp_path / "extra.gguf", "F32", extra_tensors={"blk.0.attn_q.bias": np.ones(64, np.float32)})
    with pytest.raises(ModelLoadError, match=r"unexpected tensors \[blk\.0\.attn_q\.bias\]"):
        load_model(str(path), torch.float32, "cpu")


@pytest.mark.parametrize(("metadata", "message"), [
    # A small file claiming sizes that would allocate 262 GB: refused before allocating.
    ({"llama.embedding_length": 65536, "llama.rope.dimension_count": 16384, "llama.feed_forward_length": 1 << 20,
      "llama.vocab_size": 1 << 20}, r"tensors do not have the shapes its metadata implies: token_embd\.weight is"),
    ({"llama.attention.head_count": 0}, r"llama\.attention\.head_count is 0; it must be a positive count"),
    ({"tokenizer.ggml.bos_token_id": 1_000_000}, r"tokenizer\.ggml\.bos_token_id 1000000 is not a token id"),
    ({"llama.context_length": 1 << 31}, r"context_length 2,147,483,648 is past the 4,194,304 positions"),
], ids=["sizes-past-the-tensors", "no-heads", "bos-past-the-vocab", "context-length"])
def test_hostile_metadata_is_a_load_error_before_allocating(tmp_path, metadata, message):
    path, _ = write_gguf(tmp_path / "hostile.gguf", "F32", metadata=metadata)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path), torch.float32, "cpu")


def test_directory_with_two_gguf_files(tmp_path):
    write_gguf(tmp_path / "a.gguf", "F32")
    write_gguf(tmp_path / "b.gguf", "Q8_0")
    with pytest.raises(ModelLoadError, match=r"exactly one \.gguf file to serve, it holds 2 \(a\.gguf, b\.gguf\)"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_model_service_refuses_a_bad_gguf_at_start_up(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)
    with start_cache_service(tmp_path, "--kv-cache-bytes", "4MiB") as cache:
        with pytest.raises(RuntimeError, match="exited with code") as raised:
            start_model_service(tmp_path, cache.address, "--model", str(bad))
    assert "is not a readable GGUF file" in str(raised.value)
    assert "Traceback" not in str(raised.value)
