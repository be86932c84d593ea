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

from array import array
from collections import deque
from collections.abc import Hashable, Iterator, Sequence

# A continuation token is proposed only while at least this share of the matched
# context's occurrences went on with it (vLLM's suffix_decoding_min_token_prob).
MIN_TOKEN_SHARE = 0.1

ROOT = 0
NONE = -1


class SuffixTrie:
    """One namespace's outputs: every suffix of each, cut at `depth` tokens, with counts.

    Nodes are numbers (the root 0). Each node's count, token, first child and siblings lie
    in arrays, and the edges in one dict from (parent << 32 | token) to child: ints only,
    which the garbage collector does not track. A trie of objects (a node each, a dict of
    children each) held a million or more of them at the history's default bound, and
    every full collection walked them all while the model service stood still: pauses of
    hundreds of milliseconds, triggered by whatever allocated next."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.nodes = 0  # live nodes, the root not counted
        self._count = array("q", [0])  # occurrences of the path to the node
        self._token = array("l", [NONE])
        self._first = array("l", [NONE])  # its first child
        self._next = array("l", [NONE])  # its siblings, both ways
        self._prev = array("l", [NONE])
        self._parent = array("l", [NONE])
        self._edges: dict[int, int] = {}
        self._free = array("l")  # numbers of removed nodes, taken again first

    def child(self, node: int, token: int) -> int:
        """`node`'s child by `token`, or NONE."""
        return self._edges.get(node << 32 | token, NONE)

    def children(self, node: int) -> Iterator[int]:
        child = self._first[node]
        while child != NONE:
            yield child
            child = self._next[child]

    def _grow(self, node: int, token: int) -> int:
        """Makes `node`'s child by `token` (count 0), which it does not have yet."""
        if self._free:
            child = self._free.pop()
            self._count[child], self._token[child], self._first[child] = 0, token, NONE
            self._parent[child] = node
        else:
            child = len(self._count)
            self._count.append(0)
            self._token.append(token)
            self._first.append(NONE)
            self._next.append(NONE)
            self._prev.append(NONE)
            self._parent.append(node)
        first = self._first[node]
        self._next[child], self._prev[child] = first, NONE
        if first != NONE:
            self._prev[first] = child
        self._first[node] = child
        self._edges[node << 32 | token] = child
        self.nodes += 1
        return child

    def _drop(self, child: int) -> None:
        """Removes `child` and everything under it."""
        first, following, before = self._first, self._next, self._prev
        parent, after, ahead = self._parent[child], following[child], before[child]
        if ahead == NONE:
            first[parent] = after
        else:
            following[ahead] = after
        if after != NONE:
            before[after] = ahead
        edges, tokens, parents, free = self._edges, self._token, self._parent, self._free
        stack = [child]
        while stack:
            node = stack.pop()
            below = first[node]
            while below != NONE:
                stack.append(below)
                below = following[below]
            del edges[parents[node] << 32 | tokens[node]]
            free.append(node)
            self.nodes -= 1

    def add(self, tokens: Sequence[int]) -> None:
        counts, edges, depth = self._count, self._edges, self.depth
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + depth]:
                child = edges.get(node << 32 | token, NONE)
                if child == NONE:
                    child = self._grow(node, token)
                counts[child] += 1
                node = child

    def remove(self, tokens: Sequence[int]) -> None:
        """Counts out an output `add` counted in (its nodes left at 0 go)."""
        counts, edges, depth = self._count, self._edges, self.depth
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + depth]:
                child = edges[node << 32 | token]
                counts[child] -= 1
                if counts[child] == 0:
                    self._drop(child)
                    break
                node = child

    def paths(self) -> dict[tuple[int, ...], int]:
        """Every path from the root, with its count: what the trie holds, whatever the
        order it was built in (for tests and inspection)."""
        found: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(ROOT, ())]
        while stack:
            node, path = stack.pop()
            for child in self.children(node):
                below = (*path, self._token[child])
                found[below] = self._count[child]
                stack.append((child, below))
        return found

    def propose(self, context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
        """Up to k tokens that most often followed the longest suffix of `context`
        (max_n down to min_n tokens) seen in the outputs; [] when none was seen."""
        return self.propose_scored(context, min_n, max_n, k)[0]

    def propose_scored(self, context: Sequence[int], min_n: int, max_n: int, k: int) -> tuple[list[int], list[float]]:
        """`propose`'s tokens, and each position's share of the matched context's
        occurrences that went on that way up to it (Arctic Inference's probabilities):
        their sum is the tokens the proposal expects kept, what a proposal from another trie
        is weighed against, and each one how far a step should trust that position."""
        counts, tokens = self._count, self._token
        for n in range(min(max_n, len(context), self.depth - 1), min_n - 1, -1):
            node = ROOT
            for token in context[len(context) - n:]:
                node = self.child(node, token)
                if node == NONE:
                    break
            if node == NONE or self._first[node] == NONE:
                continue
            proposal: list[int] = []
            shares: list[float] = []
            share = 1.0
            # The match's path plus the proposal stay within the trie's depth.
            while self._first[node] != NONE and len(proposal) < min(k, self.depth - n):
                # The most frequent; on a tie the lowest id, so the answer does not hang on insertion order.
                child = max(self.children(node), key=lambda c: (counts[c], -tokens[c]))
                seen = self._followed(node)
                if counts[child] < MIN_TOKEN_SHARE * seen:
                    break
                proposal.append(tokens[child])
                share *= counts[child] / seen
                shares.append(share)
                node = child
            return proposal, shares
        return [], []

    def _followed(self, node: int) -> int:
        """The occurrences of `node`'s path that a token could have followed: here all of
        them (an output that ended there counts against every continuation)."""
        return self._count[node]


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
            if not old_trie.nodes:
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
