"""The suffix proposer over a sequence's own tokens: every suffix of its prompt and output
so far, cut at a depth, counted in a trie as tokens arrive (the per-request tree that vLLM's
suffix decoding keeps beside its global one).

Against the ngram index (ngram.py), which follows the latest earlier occurrence of the
last few tokens, the trie follows the continuation seen most often and says how sure it is
(SuffixTrie.propose_scored), so the suffix proposer can weigh a proposal from the request's
own text against one from earlier outputs and take the likelier (spec/speculator.py).

Pure bookkeeping over token ids, no tensors. Appending a token costs one step down from
each of the last `depth` suffixes; nothing is ever removed (only kept tokens arrive).
"""

from __future__ import annotations

from collections.abc import Iterable

from model_service.spec.suffix import NONE, ROOT, SuffixTrie


class RequestTrie(SuffixTrie):
    """One sequence's suffixes; `taken` counts the tokens it has taken in."""

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.taken = 0
        # The nodes of the suffixes that can still grow (shorter than depth), longest first.
        self._open: list[int] = []

    def extend(self, tokens: Iterable[int]) -> None:
        counts, edges = self._count, self._edges
        for token in tokens:
            grown = []
            for node in (*self._open, ROOT):
                child = edges.get(node << 32 | token, NONE)
                if child == NONE:
                    child = self._grow(node, token)
                counts[child] += 1
                grown.append(child)
            # The longest has reached the depth: it is counted, and grows no further.
            self._open = grown[-(self.depth - 1):] if self.depth > 1 else []
            self.taken += 1

    def _followed(self, node: int) -> int:
        # The occurrence that ends at the sequence's last token is where the proposal goes
        # on from, not an occurrence that nothing followed.
        return self._count[node] - (node in self._open)
