"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's own last n tokens (vLLM's `ngram` method, `prompt_lookup_min/max`).

Pure bookkeeping over token ids, no tensors. The index is built as tokens arrive, so a
proposal costs (max_n - min_n + 1) dictionary lookups whatever the sequence's length,
instead of a scan of the whole context at every step.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One sequence's n-grams (min_n..max_n tokens long), each mapped to the position
    just after its latest occurrence that has a token after it.

    Only accepted tokens are ever appended, so rejected proposals need no rollback here.
    """

    __slots__ = ("min_n", "max_n", "tokens", "_after")

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            # The n-grams ending at the current last token now have a follower: `token`,
            # at position p. A later occurrence overwrites an earlier one (latest wins:
            # the nearer past is the likelier continuation of what is being written now).
            p = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, p) + 1):
                self._after[tuple(self.tokens[p - n:p])] = p
            self.tokens.append(token)

    @property
    def taken(self) -> int:
        """Tokens indexed so far."""
        return len(self.tokens)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest (max_n down to min_n) earlier
        occurrence of the sequence's suffix; [] when no suffix of those lengths recurs."""
        if k <= 0:
            return []
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._after.get(tuple(self.tokens[length - n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []
