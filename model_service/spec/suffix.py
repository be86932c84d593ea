"""Suffix decoding's history: the outputs this service generated for earlier requests, as
a bounded suffix trie per namespace, asked for the likeliest continuation of a sequence's
last few tokens (vLLM's `suffix` method, after Arctic Inference's global suffix tree).

A namespace is a tenant with a cache salt (a LoRA adapter's namespace is in its salt): one
tenant's outputs never feed another tenant's proposals, which would show it text another
tenant was served, token by token, in what its requests accept. Memory is bounded by the
output tokens held (`max_tokens`, over every namespace): past it the oldest outputs leave,
their suffixes counted out of their trie, and a namespace left empty goes. Each token
held costs at most `depth` trie nodes (the suffixes starting at it, cut at `depth`).

Pure bookkeeping over token ids, no tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

# A continuation token is proposed only while at least this share of the matched
# context's occurrences went on with it (vLLM's suffix_decoding_min_token_prob).
MIN_TOKEN_SHARE = 0.1


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the path to here
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """One namespace's outputs: every suffix of each, cut at `depth` tokens, with counts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.nodes = 0

    def add(self, tokens: Sequence[int]) -> None:
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.nodes += 1
                child.count += 1
                node = child

    def remove(self, tokens: Sequence[int]) -> None:
        """Counts out an output `add` counted in (its nodes left at 0 go)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    self.nodes -= _size(child)
                    del node.children[token]
                    break
                node = child

    def propose(self, context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
        """Up to k tokens that most often followed the longest suffix of `context`
        (max_n down to min_n tokens) seen in the outputs; [] when none was seen."""
        return self.propose_scored(context, min_n, max_n, k)[0]

    def propose_scored(self, context: Sequence[int], min_n: int, max_n: int, k: int) -> tuple[list[int], list[float]]:
        """`propose`'s tokens, and each position's share of the matched context's
        occurrences that went on that way up to it (Arctic Inference's probabilities):
        their sum is the tokens the proposal expects kept, what a proposal from another trie
        is weighed against, and each one how far a step should trust that position."""
        for n in range(min(max_n, len(context), self.depth - 1), min_n - 1, -1):
            node = self.root
            for token in context[len(context) - n:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            proposal: list[int] = []
            shares: list[float] = []
            share = 1.0
            # The match's path plus the proposal stay within the trie's depth.
            while node.children and len(proposal) < min(k, self.depth - n):
                # The most frequent; on a tie the lowest id, so the answer does not hang on insertion order.
                token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
                seen = self._followed(node)
                if child.count < MIN_TOKEN_SHARE * seen:
                    break
                proposal.append(token)
                share *= child.count / seen
                shares.append(share)
                node = child
            return proposal, shares
        return [], []

    def _followed(self, node: _Node) -> int:
        """The occurrences of `node`'s path that a token could have followed: here all of
        them (an output that ended there counts against every continuation)."""
        return node.count


def _size(node: _Node) -> int:
    size, stack = 0, [node]
    while stack:
        current = stack.pop()
        size += 1
        stack.extend(current.children.values())
    return size


class SuffixHistory:
    """Every namespace's trie, with at most `max_tokens` output tokens held in all."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        if depth < 2 or max_tokens < 1:
            raise ValueError(f"a suffix history needs depth >= 2 and max_tokens >= 1, got {depth} and {max_tokens}")
        self.depth = depth
        self.max_tokens = max_tokens
        self.tokens = 0
        self._tries: dict[Hashable, SuffixTrie] = {}
        self._held: deque[tuple[Hashable, tuple[int, ...]]] = deque()  # oldest first

    def add(self, namespace: Hashable, output: Sequence[int]) -> None:
        """Holds a finished request's output tokens (their last `max_tokens` when longer)."""
        output = tuple(output[-self.max_tokens:])
        if not output:
            return
        trie = self._tries.get(namespace)
        if trie is None:
            trie = self._tries[namespace] = SuffixTrie(self.depth)
        trie.add(output)
        self._held.append((namespace, output))
        self.tokens += len(output)
        while self.tokens > self.max_tokens:
            old_namespace, old = self._held.popleft()
            old_trie = self._tries[old_namespace]
            old_trie.remove(old)
            self.tokens -= len(old)
            if not old_trie.root.children:
                del self._tries[old_namespace]

    def propose(self, namespace: Hashable, context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
        return self.propose_scored(namespace, context, min_n, max_n, k)[0]

    def propose_scored(self, namespace: Hashable, context: Sequence[int], min_n: int, max_n: int,
                       k: int) -> tuple[list[int], list[float]]:
        trie = self._tries.get(namespace)
        return trie.propose_scored(context, min_n, max_n, k) if trie is not None else ([], [])

    @property
    def nodes(self) -> int:
        return sum(trie.nodes for trie in self._tries.values())

    @property
    def namespaces(self) -> int:
        return len(self._tries)
