"""The ledger's holdings: the live sequences by id, by owner and by model, and each owner's
SessionLimits checked against what it holds.

Apart from ledger.py because it is the ledger's second idea. The ledger decides what a
lease op does to the block pool (which blocks, shared, fresh or promoted; what the prefix
cache keeps) and keeps every op atomic; this keeps who holds what, and the counts beside
it, consistent as the ledger tells it of each sequence that comes, grows, shrinks or goes:
each sequence is in its owner's index, each owner's block-table entries and each model's
sequences are counted, and release_owner_some's order lasts between its calls.
ledger_invariants.py checks the two against each other.
"""

from __future__ import annotations

from collections.abc import Callable

from cache_service.blocks.block_pool import Block
from cache_service.blocks.prefix_hash import Namespace
from cache_service.core.ledger_records import LimitExceeded, ModelUsage, NotOwner, SessionLimits, UnknownSequence


class LeasedSequence:
    __slots__ = ("owner", "num_tokens", "blocks", "namespace", "lora_name")

    def __init__(self, owner: str, num_tokens: int, blocks: list[Block], namespace: Namespace,
                 lora_name: str = "") -> None:
        self.owner = owner
        self.num_tokens = num_tokens
        self.blocks = blocks
        self.namespace = namespace
        self.lora_name = lora_name  # for KV events only (AllocateOp.lora_name); "": the base model


class Sequences:
    """``ledger.sequences``: what every owner and model holds. The ledger checks the pool
    and ``check_limits`` before it adds or grows anything, so these methods trust it."""

    def __init__(self, limits: SessionLimits) -> None:
        self.limits = limits
        self.by_id: dict[int, LeasedSequence] = {}
        self.by_owner: dict[str, set[int]] = {}
        self.owner_blocks: dict[str, int] = {}  # block-table entries per owner
        self.models: dict[str, ModelUsage] = {}  # by model fingerprint
        self._draining: dict[str, list[int]] = {}  # release_owner_some's order, newest last
        self._last_sequence_id = 0

    # ---------------------------------------------------------------- queries

    def get(self, sequence_id: int) -> LeasedSequence:
        sequence = self.by_id.get(sequence_id)
        if sequence is None:
            raise UnknownSequence(f"sequence {sequence_id} is not leased (never allocated or already released)")
        return sequence

    def owned(self, owner: str, sequence_id: int) -> LeasedSequence:
        sequence = self.get(sequence_id)
        if sequence.owner != owner:
            raise NotOwner(f"sequence {sequence_id} belongs to session {sequence.owner!r}, not {owner!r}")
        return sequence

    def sequence_blocks(self, sequence_id: int) -> list[int]:
        """The block table of a live sequence (for tests and debugging)."""
        return [block.block_id for block in self.get(sequence_id).blocks]

    def owner_usage(self, owner: str) -> tuple[int, int]:
        """(sequences, block-table entries) ``owner`` holds now."""
        return len(self.by_owner.get(owner, ())), self.owner_blocks.get(owner, 0)

    def model(self, fingerprint: str) -> ModelUsage:
        """Model ``fingerprint``'s usage, the live record the ledger counts into."""
        usage = self.models.get(fingerprint)
        if usage is None:
            usage = self.models[fingerprint] = ModelUsage()
        return usage

    def model_usage(self) -> dict[str, ModelUsage]:
        """Each model fingerprint's usage (a copy), for every model that has had a sequence."""
        return {fingerprint: ModelUsage(usage.sequences, usage.blocks_leased, usage.prefix_queries,
                                        usage.prefix_hits) for fingerprint, usage in self.models.items()}

    def check_limits(self, owner: str, new_sequences: int, new_blocks: int, what: str) -> None:
        sequences, blocks = self.owner_usage(owner)
        limits = self.limits
        if sequences + new_sequences > limits.max_sequences:
            raise LimitExceeded(
                f"{what} refused: session {owner!r} holds {sequences} sequences, the per-session limit "
                f"(--max-session-sequences) is {limits.max_sequences}; release some first"
            )
        if blocks + new_blocks > limits.max_blocks:
            raise LimitExceeded(
                f"{what} refused: session {owner!r} holds {blocks} block-table entries and needs {new_blocks} "
                f"more; the per-session limit (--max-session-blocks) is {limits.max_blocks}; release some first"
            )

    # ---------------------------------------------------------------- changes

    def add(self, sequence: LeasedSequence) -> int:
        """Holds a new sequence; returns its id (each a new one, counting up)."""
        self._last_sequence_id += 1
        sequence_id = self._last_sequence_id
        self.by_id[sequence_id] = sequence
        self.model(sequence.namespace[0]).sequences += 1
        owner = sequence.owner
        owned = self.by_owner.get(owner)
        if owned is None:
            self.by_owner[owner] = {sequence_id}
            self.owner_blocks[owner] = len(sequence.blocks)
        else:
            owned.add(sequence_id)
            self.owner_blocks[owner] += len(sequence.blocks)
        return sequence_id

    def resized(self, owner: str, blocks: int) -> None:
        """A sequence of ``owner``'s block table grew by ``blocks`` entries (shrank, below 0)."""
        self.owner_blocks[owner] += blocks

    def forget(self, owner: str, sequence_id: int) -> LeasedSequence:
        """Drops a sequence of ``owner``'s; returns it (its blocks are the caller's to free)."""
        sequence = self.by_id.pop(sequence_id)
        self.model(sequence.namespace[0]).sequences -= 1
        owned = self.by_owner[owner]
        owned.discard(sequence_id)
        if owned:
            self.owner_blocks[owner] -= len(sequence.blocks)
        else:
            del self.by_owner[owner]
            del self.owner_blocks[owner]
        return sequence

    def drain(self, owner: str, max_blocks: int | None,
              free: Callable[[LeasedSequence], None]) -> tuple[int, bool]:
        """Forgets whole sequences of ``owner`` until about ``max_blocks`` block references
        are given back (None: all), handing each to ``free`` as it goes (the ledger's
        release_owner_some). Returns (references released, whether none is left).

        The order lasts between calls, so a huge session is released a chunk per call; a
        sequence released by an op since the draining began is skipped.
        """
        order = self._draining.get(owner, [])
        released = 0
        by_id = self.by_id
        while max_blocks is None or released < max_blocks:
            if not order:
                owned = self.by_owner.get(owner)
                if not owned:
                    break
                # Oldest first in the list, popped from the end: forks give back their
                # references before their parents.
                order = sorted(owned)
            sequence_id = order.pop()
            sequence = by_id.get(sequence_id)
            if sequence is None or sequence.owner != owner:
                continue  # released by an op since the draining began
            free(self.forget(owner, sequence_id))
            released += len(sequence.blocks)
        done = owner not in self.by_owner
        if done or not order:
            self._draining.pop(owner, None)
        else:
            self._draining[owner] = order
        return released, done
