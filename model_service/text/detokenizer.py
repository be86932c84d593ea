"""Incremental detokenization of a generated stream, with stop strings.

Decoding one token at a time is wrong for byte-level tokenizers (a character can span
tokens) and for SentencePiece ones (a token's leading space depends on what precedes
it). So, as in vLLM and text-generation-inference, each step decodes a short window of
recent tokens twice, up to `read_offset` and to the end, and emits only the difference,
once the window no longer ends in U+FFFD (an incomplete UTF-8 character).

Stop strings are matched on the emitted text. The longest tail that could still be the
start of a stop string is held back, so a stop string that spans tokens is found and
never half-emitted; the text is cut where the stop string begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens the first window starts before the prompt's end: enough for
# SentencePiece spacing and for a UTF-8 character cut across tokens (at most 4 bytes).
PROMPT_WINDOW_TOKENS = 5
# A window still ending in U+FFFD after this many new tokens is invalid UTF-8, not a
# character in progress (one needs at most 4 tokens); emit it rather than re-decode an
# ever longer window on every step.
MAX_PENDING_TOKENS = 16


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class DetokenizedDelta:
    text: str
    stopped: bool
    matched: str | None = None  # the stop string found, when stopped


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str], *,
                 include_stop_str: bool = False, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._include_stop_str = include_stop_str
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._token_ids) - PROMPT_WINDOW_TOKENS, 0)
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._stop = tuple(stop)
        if any(not s for s in self._stop):
            raise ValueError("stop strings must be non-empty")
        self._held = ""  # decoded text not yet emitted: it may begin a stop string
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; nothing more is emitted after it."""
        return self._stopped

    def push(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add generated tokens; return the text now safe to emit."""
        if self._stopped:
            return DetokenizedDelta("", True)
        self._token_ids.extend(token_ids)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At the end of generation: emit everything still held back."""
        if self._stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True).text

    def _decode(self, start: int, end: int) -> str:
        ids = self._token_ids[start:end]
        if self._skip_special_tokens:  # every tokenizer's default
            return self._tokenizer.decode(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _decode_new(self, *, final: bool) -> str:
        end = len(self._token_ids)
        if end == self._read_offset:
            return ""
        window_text = self._decode(self._prefix_offset, end)
        if window_text.endswith(REPLACEMENT_CHAR) and not final:
            # A character may be in progress in the last tokens (its bytes so far fill at
            # most 3 tokens): emit what precedes them, so pushing several tokens at a time
            # does not hold back whole characters that are already complete.
            for cut in range(end - 1, max(self._read_offset, end - 4), -1):
                text = self._decode(self._prefix_offset, cut)
                if not text.endswith(REPLACEMENT_CHAR):
                    window_text, end = text, cut
                    break
            else:
                if end - self._read_offset < MAX_PENDING_TOKENS:
                    return ""
        # The window may decode no longer than its prefix (a tokenizer that merges or
        # cleans up across the boundary): then there is nothing new to emit yet. Tokens
        # that decode to nothing at all (skipped specials) would grow the window, and the
        # cost of each step with it, forever: past MAX_PENDING_TOKENS the window moves on.
        new_text = window_text[len(self._prefix_text):]
        if not new_text and not final and end - self._read_offset < MAX_PENDING_TOKENS:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return new_text

    def _release(self, new_text: str, *, final: bool) -> DetokenizedDelta:
        text = self._held + new_text
        if not self._stop:
            self._held = ""
            return DetokenizedDelta(text, False)
        found = _first_stop(text, self._stop)
        if found is not None:
            stop_at, matched = found
            self._held = ""
            self._stopped = True
            end = stop_at + len(matched) if self._include_stop_str else stop_at
            return DetokenizedDelta(text[:end], True, matched)
        hold = 0 if final else _longest_stop_prefix_suffix(text, self._stop)
        self._held = text[len(text) - hold:] if hold else ""
        return DetokenizedDelta(text[: len(text) - hold], False)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text`, or None."""
    found = [(index, stop) for index, stop in ((text.find(stop), stop) for stop in stops) if index >= 0]
    return min(found, key=lambda pair: pair[0]) if found else None


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        # Candidate tails start where stop[0] occurs within the last len(stop)-1 chars;
        # the earliest such start that matches is the longest for this stop string.
        start = max(len(text) - (len(stop) - 1), 0)
        while True:
            start = text.find(stop[0], start)
            if start < 0 or len(text) - start <= longest:
                break
            if stop.startswith(text[start:]):
                longest = len(text) - start
                break
            start += 1
    return longest
