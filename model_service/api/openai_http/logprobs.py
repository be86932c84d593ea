"""GenerateResponse.logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob,
bytes, top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

A token is named by its own decoded text (special tokens included), or, with vLLM's
return_tokens_as_token_ids, as "token_id:N" so a client can map it back exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from model_service.text.tokenizer import Tokenizer
from pagedkv.model.v1 import model_pb2


class TokenNames:
    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_token_ids = as_token_ids
        self.text = lru_cache(maxsize=65536)(self._text)
        self.name = lru_cache(maxsize=65536)(self._name)

    def _text(self, token_id: int) -> str:
        """The token's own decoded text (special tokens included)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_token_ids else self.text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        decode_bytes = getattr(self._tokenizer, "decode_bytes", None)
        if decode_bytes is not None:  # byte-level: the token's own bytes, even half a character
            return list(decode_bytes([token_id], skip_special_tokens=False))
        return list(self._tokenizer.decode([token_id], skip_special_tokens=False).encode())


def chat_logprobs(entries: Iterable[model_pb2.TokenLogprob], names: TokenNames) -> list[dict[str, Any]]:
    """The entries of chat's logprobs.content."""
    return [
        {
            "token": names.name(entry.token_id),
            "logprob": entry.logprob,
            "bytes": names.bytes(entry.token_id),
            "top_logprobs": [
                {"token": names.name(top.token_id), "logprob": top.logprob, "bytes": names.bytes(top.token_id)}
                for top in entry.top
            ],
        }
        for entry in entries
    ]


def completion_logprobs(entries: Iterable[model_pb2.TokenLogprob], names: TokenNames,
                        text_offset: int, text_length: int) -> dict[str, list]:
    """Completions' logprobs object for the entries of one message whose text (text_length
    characters) starts at text_offset within the choice's text. Each token's text_offset
    is where its text starts: the message's first token at the message's start, each later
    one after the decoded text of those before it (not after their names, which may be
    "token_id:N"), never past the message's end (the detokenizer may hold back part of a
    character). Offsets thus only grow, however many tokens a message carries."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    end = text_offset + text_length
    for entry in entries:
        tokens.append(names.name(entry.token_id))
        token_logprobs.append(entry.logprob)
        top_logprobs.append({names.name(top.token_id): top.logprob for top in entry.top})
        offsets.append(min(text_offset, end))
        text_offset += len(names.text(entry.token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict[str, list]]) -> dict[str, list] | None:
    if not parts:
        return None
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged
