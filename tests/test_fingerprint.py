"""The model fingerprint: content, not names or paths, for every kind of checkpoint."""

from __future__ import annotations

import shutil

import pytest

from harness.hf_checkpoints import write_checkpoint
from model_service.errors import ModelLoadError
from model_service.loading.fingerprint import checkpoint_fingerprint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("fingerprint") / "llama")


def flip_one_byte(path, offset_from_end: int = 1) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_same_content_anywhere_is_the_same_model(checkpoint, tmp_path):
    fingerprint = checkpoint_fingerprint(checkpoint)
    assert fingerprint.startswith("xxh3_128:") and len(fingerprint) == len("xxh3_128:") + 32
    copy = shutil.copytree(checkpoint, tmp_path / "elsewhere")
    (copy / "README.md").write_text("not part of the model")
    assert checkpoint_fingerprint(copy) == fingerprint
    assert checkpoint_fingerprint(str(copy)) == fingerprint


@pytest.mark.parametrize("file_name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_one_byte_of_weights_config_or_tokenizer_is_another_model(checkpoint, tmp_path, file_name):
    copy = shutil.copytree(checkpoint, tmp_path / "changed")
    if file_name.endswith(".json"):
        path = copy / file_name
        path.write_text(path.read_text() + " ")
    else:
        flip_one_byte(copy / file_name)  # the last byte of the last tensor's data
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(checkpoint)


def test_sharded_checkpoint_covers_every_shard(tmp_path):
    sharded = write_checkpoint("llama-sharded", tmp_path / "sharded")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    before = checkpoint_fingerprint(sharded)
    flip_one_byte(shards[0])
    assert checkpoint_fingerprint(sharded) != before


def test_a_single_file_checkpoint_is_fingerprinted_by_content(tmp_path):
    first = tmp_path / "model-a.gguf"
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(first.read_bytes())
    assert checkpoint_fingerprint(first) == checkpoint_fingerprint(renamed)
    flip_one_byte(renamed, 1000)
    assert checkpoint_fingerprint(first) != checkpoint_fingerprint(renamed)


def test_tiny_is_stable_and_differs_from_checkpoints(checkpoint):
    assert checkpoint_fingerprint("tiny") == checkpoint_fingerprint("tiny")
    assert checkpoint_fingerprint("tiny") != checkpoint_fingerprint(checkpoint)


def test_what_cannot_be_fingerprinted_says_why(tmp_path):
    with pytest.raises(ModelLoadError, match="neither 'tiny' nor an existing"):
        checkpoint_fingerprint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config, tokenizer or weight files"):
        checkpoint_fingerprint(tmp_path / "empty")
