"""What speculative decoding runs with (--speculative-method, --num-speculative-tokens,
--speculative-max-tokens, --prompt-lookup-min/max, --suffix-cache-tokens), checked once so every front door gives
the same message."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "suffix")
# A verified chunk is K + 1 query rows per sequence in a step that every other stream
# waits for; past this many, a rejected tail costs more than the accepted head saves.
MAX_SPECULATIVE_TOKENS = 16
# Longer n-grams than this almost never recur verbatim where shorter ones do not, and
# each length costs an index entry per token.
MAX_LOOKUP_N = 32
# The suffix proposer's history holds each output token in up to (--prompt-lookup-max +
# --num-speculative-tokens) trie nodes of about a hundred bytes each.
MAX_SUFFIX_CACHE_TOKENS = 1 << 22


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    method: str | None = None  # None: off
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_cache_tokens: int = 65536
    # --speculative-max-tokens: 0 proposes num_speculative_tokens every step (vLLM's fixed K);
    # N lets each sequence's proposal length move between 1 and N with what it keeps
    # (spec/adaptive.py), starting at num_speculative_tokens.
    max_speculative_tokens: int = 0
    # Verify every proposal, whatever a step costs (else spec/step_costs.py weighs them).
    always: bool = False

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--num-speculative-tokens must be from 1 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.max_speculative_tokens and not (
                self.num_speculative_tokens <= self.max_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"--speculative-max-tokens must be 0 (a fixed length) or from --num-speculative-tokens "
                             f"({self.num_speculative_tokens}) to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.max_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= MAX_LOOKUP_N:
            raise ValueError(f"--prompt-lookup-min must be from 1 to {MAX_LOOKUP_N}, got {self.prompt_lookup_min}")
        if not self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_LOOKUP_N:
            raise ValueError(f"--prompt-lookup-max must be from --prompt-lookup-min ({self.prompt_lookup_min}) "
                             f"to {MAX_LOOKUP_N}, got {self.prompt_lookup_max}")
        if not 1 <= self.suffix_cache_tokens <= MAX_SUFFIX_CACHE_TOKENS:
            raise ValueError(f"--suffix-cache-tokens must be from 1 to {MAX_SUFFIX_CACHE_TOKENS}, "
                             f"got {self.suffix_cache_tokens}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def adaptive(self) -> bool:
        return self.max_speculative_tokens > 0

    @property
    def longest(self) -> int:
        """The most tokens one proposal can hold."""
        return self.max_speculative_tokens or self.num_speculative_tokens
