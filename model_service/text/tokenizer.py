"""Text <-> token ids: a Hugging Face tokenizer.json, or every byte a token (tiny model).

Decoding a list of ids that ends inside a multi-byte UTF-8 character yields U+FFFD for the
incomplete bytes (errors="replace"), never an exception: the incremental detokenizer
decodes growing windows of ids and holds text back while it ends in U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from model_service.errors import ModelLoadError


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0-255 are the bytes themselves; specials follow. Like Llama's tokenizers,
    `encode` puts a BOS token first unless add_special_tokens=False."""

    NUM_BYTES = 256
    BOS, EOS, PAD, UNK = 256, 257, 258, 259
    SPECIAL_TOKENS = {BOS: "<s>", EOS: "</s>", PAD: "<pad>", UNK: "<unk>"}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + len(self.SPECIAL_TOKENS)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> bytes:
        out = bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < self.NUM_BYTES:
                out.append(token_id)
            elif token_id in self.SPECIAL_TOKENS:
                if not skip_special_tokens:
                    out += self.SPECIAL_TOKENS[token_id].encode()
            else:
                raise ValueError(f"token id {token_id} outside vocabulary of {self.vocab_size}")
        return bytes(out)


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self._bos_token_id = bos_token_id

    @classmethod
    def from_dir(
        cls, directory: str | Path, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None
    ) -> HFTokenizer:
        """eos/bos default to those named in tokenizer_config.json when not given (the
        model config's generation_config.json ids take precedence)."""
        from tokenizers import Tokenizer as RawTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"missing tokenizer.json in {directory} (only the fast tokenizer format is supported)")
        try:
            raw = RawTokenizer.from_file(str(path))
        except Exception as error:  # the Rust library raises its own exception type
            raise ModelLoadError(f"cannot read {path}: {error}") from None
        special = special_tokens_from_config(directory / "tokenizer_config.json")
        if not eos_token_ids and special.get("eos_token") is not None:
            eos_id = raw.token_to_id(special["eos_token"])
            eos_token_ids = () if eos_id is None else (eos_id,)
        if bos_token_id is None and special.get("bos_token") is not None:
            bos_token_id = raw.token_to_id(special["bos_token"])
        return cls(raw, eos_token_ids, bos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works; encode holds it throughout, and a
        # prompt of megabytes takes seconds: every other thread (the engine, the cache
        # session's heartbeat, the event loop) would stop for as long.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str | None:
        """The vocabulary entry of one id (a special token's text, like "<|im_end|>")."""
        return None if token_id is None else self._tokenizer.id_to_token(int(token_id))


def special_tokens_from_config(path: Path) -> dict[str, str | None]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}

    def content(value):
        # Either "</s>" or {"content": "</s>", ...} (AddedToken serialized).
        return value.get("content") if isinstance(value, dict) else value

    return {key: content(raw.get(key)) for key in ("eos_token", "bos_token")}
