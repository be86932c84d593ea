"""Prompts held back while another sequence computes the prefix they share.

A waiting prompt whose leading full blocks are being computed by a sequence that runs (or
is being admitted) would compute them a second time if admitted now: the prefix cache
finds only committed blocks, and a block is committed in the first lease call after its
K/V is written (Scheduler._commits_due). Held until those blocks are committed, the prompt
gets them as cached tokens instead: under a shared system prompt or document, a burst of
requests computes each prefix once rather than once a request (SGLang's scheduler defers
such prompts for the same reason). What is held is only admission order: the cache
service alone decides what a prompt finds, so a wrong guess costs a step, never a wrong
token.

A block is named by its chain (namespace, every token up to its end), as the cache
service's prefix index names it, hashed: blocks of different tenants or cache salts, or
with different tokens before them, never match.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from model_service.sched.sequence import Sequence


class BlockChains:
    """Each sequence's chain hashes of its full blocks, as far as asked for: tokens only ever
    grow, so each block is hashed once. The scheduler keeps one for its life (one block
    size); a sequence's hashes go with the sequence."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: weakref.WeakKeyDictionary[Sequence, list[int]] = weakref.WeakKeyDictionary()

    def of(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Hashes of the chains of seq's full blocks within its first `num_tokens` tokens."""
        chain = self._chains.get(seq)
        if chain is None:
            chain = self._chains[seq] = []
        block_size = self.block_size
        wanted = num_tokens // block_size
        tokens = seq.token_ids
        while len(chain) < wanted:
            start = len(chain) * block_size
            parent = chain[-1] if chain else hash((seq.tenant, seq.cache_salt))
            chain.append(hash((parent, *tokens[start:start + block_size])))
        return chain[:wanted]


class InflightPrefixes:
    """The full blocks that sequences will compute but have not committed, by chain; and
    which waiting prompts to hold for them (at least `min_tokens` of their prompt). Made
    for one admission pass."""

    def __init__(self, chains: BlockChains, min_tokens: int) -> None:
        self.chains = chains
        self.block_size = chains.block_size
        self.min_tokens = min_tokens
        self._pending: set[int] = set()

    @property
    def active(self) -> bool:
        return bool(self.min_tokens and self._pending)

    def track(self, seqs: Iterable[Sequence]) -> None:
        """Sequences that run or are being given blocks: their prompt's full blocks from
        the first not yet computed (what is computed is committed in this step's call,
        before any allocation in it) are pending."""
        if not self.min_tokens:
            return
        for seq in seqs:
            committed = seq.num_computed // self.block_size
            if committed < seq.prompt_len // self.block_size:
                self._pending.update(self.chains.of(seq, seq.prompt_len)[committed:])

    def holds(self, seq: Sequence) -> bool:
        """Whether seq should wait: it would look its prompt up in the prefix cache, and at
        least min_tokens of its leading blocks are pending (its last token is always
        computed, so only blocks before it count)."""
        if not self.active or not seq.reuse_prefix:
            return False
        chain = self.chains.of(seq, len(seq.token_ids) - 1)
        shared = sum(self.block_size for key in chain if key in self._pending)
        return shared >= self.min_tokens
