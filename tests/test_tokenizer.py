"""ByteTokenizer (tiny model) and HFTokenizer (tokenizer.json) behave as the engine expects."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from harness.hf_checkpoints import BOS_ID, EOS_ID, write_tokenizer
from model_service.errors import ModelLoadError
from model_service.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TEXTS = ["hello world", "Grüße, naïve café", "日本語のテキスト", "emoji 🙂 and 👩‍👩‍👧", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.BOS and ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_specials_and_partial_characters():
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == 260 and tokenizer.eos_token_ids == (257,)
    ids = tokenizer.encode("a🙂", add_special_tokens=False)  # 1 + 4 bytes
    assert tokenizer.decode(ids[:3]) == "a\ufffd"  # cut inside the emoji: replaced, no error
    assert tokenizer.decode(ids) == "a🙂"
    assert tokenizer.decode([tokenizer.BOS, *ids, tokenizer.EOS], skip_special_tokens=False) == "<s>a🙂</s>"
    assert tokenizer.decode([tokenizer.BOS, *ids, tokenizer.EOS]) == "a🙂"
    with pytest.raises(ValueError, match="outside vocabulary"):
        tokenizer.decode([260])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    return directory


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trip(tokenizer_dir, text):
    tokenizer = HFTokenizer.from_dir(tokenizer_dir, eos_token_ids=[EOS_ID])
    ids = tokenizer.encode(text)
    assert ids[0] == BOS_ID  # the template adds <s>
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_hf_tokenizer_specials_and_partial_characters(tokenizer_dir):
    tokenizer = HFTokenizer.from_dir(tokenizer_dir, eos_token_ids=[EOS_ID])
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == 320 and tokenizer.eos_token_ids == (EOS_ID,)
    assert tokenizer.bos_token_id == BOS_ID  # from tokenizer_config.json
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces of one character
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=False) == "<s>🙂</s>"


def test_hf_tokenizer_eos_from_tokenizer_config(tokenizer_dir):
    assert HFTokenizer.from_dir(tokenizer_dir).eos_token_ids == (EOS_ID,)


def test_hf_tokenizer_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="missing tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        HFTokenizer.from_dir(tmp_path)


def test_hf_encode_lets_other_threads_run(tokenizer_dir):
    """Tokenizing a long prompt must not hold the GIL throughout: the engine and the cache
    session's heartbeat run on threads of the same process. With a switch interval longer
    than the test, another thread gets the GIL only where the encoding gives it up."""
    tokenizer = HFTokenizer.from_dir(tokenizer_dir)
    text = "hello world, " * 15_000
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # releases the GIL, then waits to take it back

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    sys.setswitchinterval(1000.0)
    try:
        before = ticks[0]
        ids = tokenizer.encode(text)
        during = ticks[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert len(ids) > 15_000
    assert during > 0, "no other thread ran while a long prompt was tokenized: the GIL was held throughout"
