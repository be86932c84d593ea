"""Random sequences of ledger operations against a simple reference model.

The model keeps, per live sequence, its owner, its token ids and its block table, and
simulates the KV pool itself: ``self.kv[block_id][slot]`` is what the K/V the model
service would have written there depends on: the whole prefix up to and including that
position (attention makes a token's K/V a function of everything before it). Fresh blocks are written as the model service
would write them; reused (prefix-hit) and shared (forked) blocks are only read. So:
- a prefix hit must return blocks whose simulated K/V already holds the prompt's tokens;
- a block handed out while another sequence still uses it, or a shared block written to,
  shows up as a live sequence whose blocks no longer hold its tokens.

Several sessions (owners) serve two models, requests carry cache salts: the simulated
K/V also records the model and salt it was written under, so a prefix hit across models
or salts shows up as a block holding someone else's K/V. Forks name how many tokens the
parent has written; per-session limits on sequences and block-table entries are low
enough to be hit; sessions are reaped whole or a chunk at a time.

Three machines run: one with Python's hash, one with a 2-bit hash, one blind to the
parent (and the namespace), so that collisions in the prefix cache happen all the time
and must never yield wrong blocks.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from cache_service.core.ledger import (
    InvalidLease,
    Ledger,
    LimitExceeded,
    NoFreeBlocks,
    NotOwner,
    SessionLimits,
    UnknownSequence,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # small, so that allocations run out of blocks and evict cached ones
OWNERS = ("a", "b", "c")
# Sessions a and b serve one model (a restarted service, or two replicas): they share
# cached prefixes; c serves another model of the same geometry: it never shares.
MODEL_OF = {"a": "model-1", "b": "model-1", "c": "model-2"}
SALTS = ("", "tenant-x")
# Low enough that random runs hit them.
LIMITS = SessionLimits(max_sequences=5, max_blocks=14)

# Prompts are mostly whole blocks drawn from three block contents, so the same prefixes
# recur (prefix hits) and the same block contents recur after different prefixes (a hit
# must match the prefix, not just the block's own tokens).
CHUNKS = [[1, 1, 1, 1], [1, 2, 1, 2], [2, 2, 1, 1]]
token_lists = st.lists(st.integers(1, 2), max_size=3)
prompts = st.builds(
    lambda chunks, tail: [token for chunk in chunks for token in chunk] + tail,
    st.lists(st.sampled_from(CHUNKS), max_size=4),
    token_lists,
)
extras = st.lists(st.integers(1, 2), max_size=6)
owners = st.sampled_from(OWNERS)
salts = st.sampled_from(SALTS)


class LedgerMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(hash)

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(NUM_BLOCKS, BLOCK_SIZE, hash_fn=self.hash_fn, limits=LIMITS)
        self.owner: dict[int, str] = {}
        self.salt: dict[int, str] = {}
        self.tokens: dict[int, list[int]] = {}
        self.table: dict[int, list[int]] = {}
        self.kv: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.released: set[int] = set()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.hit_allocations = 0
        self.history: list[tuple[str, tuple[int, ...]]] = []  # (salt, token ids) released with cache_prefix
        self.limit_refusals = 0

    sequences = Bundle("sequences")

    # ------------------------------------------------------------ helpers

    def kv_of(self, sequence_id: int, position: int) -> tuple:
        """What the K/V at `position` of a sequence is a function of: its model, the whole
        prefix, and (for isolation, not for the math) its salt."""
        owner = self.owner[sequence_id]
        return (MODEL_OF[owner], self.salt[sequence_id], tuple(self.tokens[sequence_id][: position + 1]))

    def write(self, sequence_id: int, start: int) -> None:
        """The model service writes K/V for positions start.. of the sequence."""
        table, tokens = self.table[sequence_id], self.tokens[sequence_id]
        for position in range(start, len(tokens)):
            self.kv[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = self.kv_of(sequence_id, position)

    def forget(self, sequence_id: int) -> None:
        del self.owner[sequence_id], self.tokens[sequence_id], self.table[sequence_id], self.salt[sequence_id]
        self.released.add(sequence_id)

    def usage(self, owner: str) -> tuple[int, int]:
        mine = [s for s, o in self.owner.items() if o == owner]
        return len(mine), sum(len(self.table[s]) for s in mine)

    def over_limits(self, owner: str, new_sequences: int, new_blocks: int) -> bool:
        sequences, blocks = self.usage(owner)
        return sequences + new_sequences > LIMITS.max_sequences or blocks + new_blocks > LIMITS.max_blocks

    # ------------------------------------------------------------ rules

    @rule(target=sequences, owner=owners, prompt=prompts, extra=extras, use_prompt=st.booleans(), salt=salts)
    def allocate(self, owner, prompt, extra, use_prompt, salt=""):
        tokens = prompt + extra
        prompt_ids = prompt if use_prompt else []
        needed = -(-len(tokens) // BLOCK_SIZE)
        available = self.ledger.blocks_available()
        before = self.ledger.stats()
        namespace = (MODEL_OF[owner], salt)
        if not tokens:
            with pytest.raises(InvalidLease):
                self.ledger.allocate(owner, 0, prompt_ids, namespace)
            assert self.ledger.stats() == before
            return consumes_nothing()
        try:
            allocation = self.ledger.allocate(owner, len(tokens), prompt_ids, namespace)
        except LimitExceeded:
            assert self.over_limits(owner, 1, needed)
            assert self.ledger.stats() == before
            self.limit_refusals += 1
            return consumes_nothing()
        except NoFreeBlocks as error:
            assert needed > available, f"refused {needed} blocks with {available} available: {error}"
            assert self.ledger.stats() == before
            return consumes_nothing()
        cached = allocation.cached_tokens
        assert cached % BLOCK_SIZE == 0
        if prompt_ids:
            assert cached <= (len(prompt_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
            assert cached < len(prompt_ids)
        else:
            assert cached == 0
        assert len(allocation.block_ids) == needed
        assert len(set(allocation.block_ids)) == needed
        # Reused blocks must already hold the prompt's tokens, of this model and salt.
        for position in range(cached):
            block = allocation.block_ids[position // BLOCK_SIZE]
            held = self.kv[block][position % BLOCK_SIZE]
            assert held == (*namespace, tuple(prompt_ids[: position + 1])), (
                f"prefix hit block {block} slot {position % BLOCK_SIZE} holds K/V of {held}, "
                f"expected the prompt's first {position + 1} tokens under {namespace}"
            )
        # Fresh blocks belong to no live sequence.
        live_blocks = {b for table in self.table.values() for b in table}
        for block in allocation.block_ids[cached // BLOCK_SIZE :]:
            assert block not in live_blocks, f"fresh block {block} is still in a live table"
            self.kv[block] = [None] * BLOCK_SIZE
        assert not self.over_limits(owner, 1, needed), "an allocation past the session's limits went through"
        self.prefix_queries += len(prompt_ids)
        self.prefix_hits += cached
        self.hit_allocations += cached > 0
        sequence_id = allocation.sequence_id
        assert sequence_id not in self.owner and sequence_id not in self.released
        self.owner[sequence_id] = owner
        self.salt[sequence_id] = salt
        self.tokens[sequence_id] = list(tokens)
        self.table[sequence_id] = list(allocation.block_ids)
        self.write(sequence_id, cached)
        return sequence_id

    @precondition(lambda self: self.history)
    @rule(target=sequences, data=st.data(), owner=owners, extra=extras, same_salt=st.booleans())
    def allocate_a_released_prefix(self, data, owner, extra, same_salt):
        """Ask again for what an earlier sequence cached, cut at or near a block boundary,
        from any session (of its model or not), with its salt or another."""
        salt, tokens = data.draw(st.sampled_from(self.history))
        if not same_salt:
            salt = SALTS[1 - SALTS.index(salt)]
        cut = data.draw(st.integers(0, len(tokens) // BLOCK_SIZE)) * BLOCK_SIZE + data.draw(st.sampled_from([0, 0, 1, 3]))
        return self.allocate(owner, list(tokens[:cut]), extra, True, salt)

    @rule(target=sequences, owner=owners, slack=st.integers(0, 2))
    def fill_the_plain_free_blocks(self, owner, slack):
        """Lease nearly every plain-free block, so that the next allocations must revive or
        evict cached blocks and the availability check is exercised at its edge."""
        count = min(self.ledger.stats().blocks_free - slack, LIMITS.max_blocks - self.usage(owner)[1])
        if count < 1:
            return consumes_nothing()
        return self.allocate(owner, [], [2] * (count * BLOCK_SIZE), False)

    @precondition(lambda self: self.owner)
    @rule(data=st.data(), extra=extras)
    def extend(self, data, extra):
        sequence_id = data.draw(st.sampled_from(sorted(self.owner)))
        owner = self.owner[sequence_id]
        old_len = len(self.tokens[sequence_id])
        new_len = old_len + len(extra)
        more = -(-new_len // BLOCK_SIZE) - len(self.table[sequence_id])
        available = self.ledger.blocks_available()
        try:
            new_blocks = self.ledger.extend(owner, sequence_id, new_len)
        except LimitExceeded:
            assert self.over_limits(owner, 0, more) and more <= available
            self.limit_refusals += 1
            return
        except NoFreeBlocks:
            assert more > available
            return
        assert not self.over_limits(owner, 0, more)
        assert len(new_blocks) == more
        live_blocks = {b for table in self.table.values() for b in table}
        assert not live_blocks & set(new_blocks)
        for block in new_blocks:
            self.kv[block] = [None] * BLOCK_SIZE
        self.table[sequence_id] += new_blocks
        self.tokens[sequence_id] += extra
        self.write(sequence_id, old_len)

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def extend_shrinking_is_refused(self, data):
        sequence_id = data.draw(st.sampled_from(sorted(self.owner)))
        before = self.ledger.stats()
        with pytest.raises(InvalidLease):
            self.ledger.extend(self.owner[sequence_id], sequence_id, len(self.tokens[sequence_id]) - 1)
        assert self.ledger.stats() == before

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def truncate(self, data):
        """A table cut short (TruncateOp: a rejected proposal's blocks): refused, changing
        nothing, when a block it would drop or end within is registered or shared."""
        sequence_id = data.draw(st.sampled_from(sorted(self.owner)))
        owner, tokens, table = self.owner[sequence_id], self.tokens[sequence_id], self.table[sequence_id]
        new_len = data.draw(st.integers(0, len(tokens) + 1))
        before = self.ledger.stats()
        if not 1 <= new_len <= len(tokens):
            with pytest.raises(InvalidLease, match="must keep from 1"):
                self.ledger.truncate(owner, sequence_id, new_len)
            assert self.ledger.stats() == before
            return
        keep = -(-new_len // BLOCK_SIZE)
        touched = table[keep - 1 if new_len % BLOCK_SIZE else keep:]
        in_tables = [b for other in self.table.values() for b in other]
        pool_blocks = self.ledger.pool.blocks
        if any(pool_blocks[b].block_hash is not None or in_tables.count(b) > 1 for b in touched):
            with pytest.raises(InvalidLease, match="truncate to"):
                self.ledger.truncate(owner, sequence_id, new_len)
            assert self.ledger.stats() == before
            return
        assert self.ledger.truncate(owner, sequence_id, new_len) == len(table) - keep
        after = self.ledger.stats()
        assert after.blocks_truncated == before.blocks_truncated + len(table) - keep
        assert after.blocks_free == before.blocks_free + len(table) - keep  # free, never cached
        del table[keep:], tokens[new_len:]

    @precondition(lambda self: self.owner)
    @rule(target=sequences, data=st.data())
    def fork(self, data):
        """A child of the first `written` tokens of its parent (0: all it reserved)."""
        parent = data.draw(st.sampled_from(sorted(self.owner)))
        owner = self.owner[parent]
        parent_tokens = self.tokens[parent]
        asked = data.draw(st.sampled_from([0, len(parent_tokens)]) | st.integers(1, len(parent_tokens)))
        written = asked or len(parent_tokens)
        full, partial = divmod(written, BLOCK_SIZE)
        child_len = full + (partial != 0)
        available = self.ledger.blocks_available()
        before = self.ledger.stats()
        try:
            child = self.ledger.fork(owner, parent, asked)
        except LimitExceeded:
            assert self.over_limits(owner, 1, child_len) and not (partial and available == 0)
            assert self.ledger.stats() == before
            self.limit_refusals += 1
            return consumes_nothing()
        except NoFreeBlocks:
            assert partial and available == 0
            assert self.ledger.stats() == before
            return consumes_nothing()
        assert not self.over_limits(owner, 1, child_len)
        parent_table = self.table[parent]
        assert len(child.block_ids) == child_len
        assert child.block_ids[:full] == parent_table[:full]
        if partial:
            assert child.copy == (parent_table[full], child.block_ids[-1])
            live_blocks = {b for table in self.table.values() for b in table}
            assert child.block_ids[-1] not in live_blocks
            self.kv[child.block_ids[-1]] = list(self.kv[parent_table[full]])  # the model service's copy
        else:
            assert child.copy is None
        self.owner[child.sequence_id] = owner
        self.salt[child.sequence_id] = self.salt[parent]
        self.tokens[child.sequence_id] = list(parent_tokens[:written])
        self.table[child.sequence_id] = list(child.block_ids)
        return child.sequence_id

    @precondition(lambda self: self.owner)
    @rule(data=st.data(), keep=st.integers(0, 30))
    def commit(self, data, keep):
        """A running sequence's full blocks registered while it keeps them (CommitOp): a
        later allocation of the same prefix shares them with it."""
        sequence_id = data.draw(st.sampled_from(sorted(self.owner)))
        tokens = self.tokens[sequence_id]
        token_ids = tokens[: min(keep, len(tokens))]
        before = self.ledger.stats()
        self.ledger.commit(self.owner[sequence_id], sequence_id, token_ids)
        after = self.ledger.stats()
        assert (after.blocks_leased, after.blocks_free) == (before.blocks_leased, before.blocks_free)
        entry = (self.salt[sequence_id], tuple(token_ids))
        if len(token_ids) >= BLOCK_SIZE and entry not in self.history:
            self.history.append(entry)

    @rule(sequence_id=consumes(sequences), cache_prefix=st.booleans(), keep=st.integers(0, 30), fill=st.booleans())
    def release(self, sequence_id, cache_prefix, keep, fill=False):
        if sequence_id not in self.owner:
            with pytest.raises(UnknownSequence):
                self.ledger.release(OWNERS[0], sequence_id)
            return
        tokens = self.tokens[sequence_id]
        if fill:
            # The holder may have written the rest of its last block before extending
            # (it extends only at block boundaries): caching accepts tokens up to capacity.
            old_len = len(tokens)
            tokens += [2] * (len(self.table[sequence_id]) * BLOCK_SIZE - old_len)
            self.write(sequence_id, old_len)
        token_ids = tokens[: min(keep, len(tokens))] if keep < 25 else tokens
        released = self.ledger.release(self.owner[sequence_id], sequence_id, cache_prefix, token_ids)
        entry = (self.salt[sequence_id], tuple(token_ids))
        if cache_prefix and len(token_ids) >= BLOCK_SIZE and entry not in self.history:
            self.history.append(entry)
        assert released == len(self.table[sequence_id])
        self.forget(sequence_id)

    @precondition(lambda self: self.owner)
    @rule(data=st.data(), other=owners)
    def wrong_owner_is_refused(self, data, other):
        sequence_id = data.draw(st.sampled_from(sorted(self.owner)))
        if other == self.owner[sequence_id]:
            return
        before = self.ledger.stats()
        with pytest.raises(NotOwner, match=repr(self.owner[sequence_id])):
            self.ledger.release(other, sequence_id)
        with pytest.raises(NotOwner):
            self.ledger.extend(other, sequence_id, len(self.tokens[sequence_id]) + 1)
        assert self.ledger.stats() == before

    @precondition(lambda self: self.released)
    @rule(data=st.data(), owner=owners)
    def released_sequence_is_unknown(self, data, owner):
        sequence_id = data.draw(st.sampled_from(sorted(self.released)))
        with pytest.raises(UnknownSequence):
            self.ledger.release(owner, sequence_id)
        with pytest.raises(UnknownSequence):
            self.ledger.fork(owner, sequence_id)

    @rule(owner=owners)
    def release_owner(self, owner):
        mine = [s for s, o in self.owner.items() if o == owner]
        expected = sum(len(self.table[s]) for s in mine)
        assert self.ledger.release_owner(owner) == expected
        for sequence_id in mine:
            self.forget(sequence_id)

    @precondition(lambda self: self.owner)
    @rule(owner=owners, chunk=st.integers(1, 6), calls=st.integers(1, 3))
    def reap_a_chunk_at_a_time(self, owner, chunk, calls):
        """A reaped session is released a chunk per call; other rules may run in between
        (in the service none of its own do, but the ledger must not rely on that)."""
        for _ in range(calls):
            mine = {s for s, o in self.owner.items() if o == owner}
            released, done = self.ledger.release_owner_some(owner, chunk)
            gone = {s for s in mine if s not in self.ledger.sequences.by_id}
            assert released == sum(len(self.table[s]) for s in gone)
            assert released >= chunk or done, f"released {released} < {chunk} without finishing"
            assert done == (gone == mine)
            for sequence_id in gone:
                self.forget(sequence_id)
            self.ledger.check_invariants()
            if done:
                return

    # ------------------------------------------------------------ invariants

    @invariant()
    def ledger_invariants_hold(self):
        self.ledger.check_invariants()

    @invariant()
    def ref_counts_equal_table_occurrences(self):
        counts = [0] * NUM_BLOCKS
        for sequence_id, table in self.table.items():
            assert self.ledger.sequences.sequence_blocks(sequence_id) == table
            assert len(table) == -(-len(self.tokens[sequence_id]) // BLOCK_SIZE)
            for block in table:
                counts[block] += 1
        assert [block.ref_count for block in self.ledger.pool.blocks] == counts

    @invariant()
    def every_session_within_its_limits(self):
        for owner in OWNERS:
            sequences, blocks = self.usage(owner)
            assert self.ledger.sequences.owner_usage(owner) == (sequences, blocks)
            assert sequences <= LIMITS.max_sequences and blocks <= LIMITS.max_blocks

    @invariant()
    def stats_add_up(self):
        stats = self.ledger.stats()
        leased = len({b for table in self.table.values() for b in table})
        assert stats.blocks_leased == leased
        assert stats.sequences == len(self.owner)
        assert stats.blocks_free + stats.blocks_leased + stats.blocks_cached == stats.blocks_total == NUM_BLOCKS
        assert self.ledger.blocks_available() == stats.blocks_free + stats.blocks_cached
        assert (stats.prefix_queries, stats.prefix_hits) == (self.prefix_queries, self.prefix_hits)

    @invariant()
    def every_live_sequence_reads_its_own_tokens(self):
        for sequence_id, tokens in self.tokens.items():
            table = self.table[sequence_id]
            for position in range(len(tokens)):
                held = self.kv[table[position // BLOCK_SIZE]][position % BLOCK_SIZE]
                assert held == self.kv_of(sequence_id, position), (
                    f"sequence {sequence_id} position {position}: block {table[position // BLOCK_SIZE]} "
                    f"holds K/V of {held}, expected {tokens[: position + 1]} "
                    "(a block was overwritten while in use, or reused at the wrong place)"
                )

    @invariant()
    def cached_blocks_hold_their_registered_tokens(self):
        for block in self.ledger.pool.cached.values():
            assert tuple(held[-1][-1] for held in self.kv[block.block_id]) == block.token_ids


def consumes_nothing():
    """A refused allocation or fork adds no sequence to the bundle."""
    from hypothesis.stateful import multiple

    return multiple()


class CollidingLedgerMachine(LedgerMachine):
    """Four hash values in all: unrelated prefixes collide all the time."""

    hash_fn = staticmethod(lambda key: hash(key) & 3)


class PositionBlindLedgerMachine(LedgerMachine):
    """The hash ignores the parent: equal block contents at different places, or under
    different models and salts, collide."""

    hash_fn = staticmethod(lambda key: hash(key[1]))


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedgerStateful = LedgerMachine.TestCase
TestLedgerStateful.settings = SETTINGS
TestCollidingLedgerStateful = CollidingLedgerMachine.TestCase
TestCollidingLedgerStateful.settings = SETTINGS
TestPositionBlindLedgerStateful = PositionBlindLedgerMachine.TestCase
TestPositionBlindLedgerStateful.settings = SETTINGS


def test_the_model_sees_prefix_hits():
    """Guard against a vacuous run: the random prompts do produce prefix hits."""
    machine = LedgerMachine()
    prompt = CHUNKS[0] + CHUNKS[1] + [2]
    first = machine.allocate("a", prompt, [], True)
    machine.release(first, True, 30)
    # Another model, another salt: misses. The same model and salt from another session: hits.
    assert machine.ledger.allocate("c", len(prompt), prompt, (MODEL_OF["c"], "")).cached_tokens == 0
    assert machine.ledger.allocate("b", len(prompt), prompt, (MODEL_OF["b"], SALTS[1])).cached_tokens == 0
    second = machine.allocate("b", prompt, [2], True)
    assert machine.hit_allocations == 1
    assert machine.ledger.stats().prefix_hits == 2 * BLOCK_SIZE
    machine.every_live_sequence_reads_its_own_tokens()
    machine.ledger.release("b", second)


def test_the_model_reaches_the_limits():
    """Guard against a vacuous run: the limits are low enough to be hit."""
    machine = LedgerMachine()
    for _ in range(LIMITS.max_sequences):
        machine.allocate("a", [1], [], False)
    machine.allocate("a", [1], [], False)
    assert machine.limit_refusals == 1


class TieredLedgerMachine(LedgerMachine):
    """The same machine with a host tier of 5 blocks and a disk tier behind it: demotions
    and disk writes are rules of their own, run between any others, and a prefix hit may
    promote blocks from either tier. The simulated K/V lives in a real tensor (each slot an
    id of what the K/V is a function of), so a promotion that copies the wrong bytes, or
    another prefix's, fails the same checks as a wrong pool block."""

    HOST_SLOTS = 5

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        import torch

        from cache_service.tiers.disk_tier import DiskGeometry
        from cache_service.tiers.kv_tiers import KvTiers
        from cache_service.tiers.settings import TierSettings

        self.disk_dir = tempfile.TemporaryDirectory(prefix="tiered-ledger-")
        self.names: list = [None]
        self.name_ids: dict = {None: 0}
        self.tensor = torch.zeros(1, 2, NUM_BLOCKS, BLOCK_SIZE, 1, 1, dtype=torch.int64)
        geometry = DiskGeometry(1, 1, 1, BLOCK_SIZE, torch.int64)
        self.tiers = KvTiers(self.ledger.pool, self.tensor, TierSettings(
            host_cache_bytes=self.HOST_SLOTS * geometry.payload_bytes, disk_cache_dir=self.disk_dir.name,
            disk_cache_bytes=8 * (geometry.payload_bytes + 200)), geometry.payload_bytes, geometry)
        self.ledger.tiers = self.tiers
        self.promoted = 0
        allocate = self.ledger.allocate

        def allocate_reading_promotions(*args, **kwargs):
            # A promoted block's K/V is whatever the tier copied into the pool tensor.
            allocation = allocate(*args, **kwargs)
            tiered = allocation.cached_tokens_host + allocation.cached_tokens_disk
            self.promoted += tiered
            for block in allocation.block_ids[: allocation.cached_tokens // BLOCK_SIZE]:
                self.kv[block] = [self.names[int(value)] for value in self.tensor[0, 0, block, :, 0, 0]]
            return allocation

        self.ledger.allocate = allocate_reading_promotions

    def teardown(self) -> None:
        self.disk_dir.cleanup()

    @rule(count=st.integers(1, 6))
    def demote(self, count):
        self.tiers.demotions.demote_some(count)

    @rule()
    def write_a_block_to_disk(self):
        import asyncio

        asyncio.run(self.tiers.demotions.write_some())

    @invariant()
    def the_pool_tensor_holds_the_simulated_kv(self):
        for block in range(NUM_BLOCKS):
            for slot, held in enumerate(self.kv[block]):
                if held not in self.name_ids:
                    self.name_ids[held] = len(self.names)
                    self.names.append(held)
                self.tensor[0, 0, block, slot, 0, 0] = self.name_ids[held]


class CollidingTieredLedgerMachine(TieredLedgerMachine):
    hash_fn = staticmethod(lambda key: hash(key) & 3)


TestTieredLedgerStateful = TieredLedgerMachine.TestCase
# Fewer examples than the pool-only machines: each step here also copies tensors and files.
TIERED_SETTINGS = settings(SETTINGS, max_examples=30)
TestTieredLedgerStateful.settings = TIERED_SETTINGS
TestCollidingTieredLedgerStateful = CollidingTieredLedgerMachine.TestCase
TestCollidingTieredLedgerStateful.settings = TIERED_SETTINGS


def test_the_tiered_model_promotes():
    """Guard against a vacuous run: a cached prefix evicted from the pool comes back from a tier."""
    machine = TieredLedgerMachine()
    machine.the_pool_tensor_holds_the_simulated_kv()
    prompt = CHUNKS[0] + CHUNKS[1] + [2]
    first = machine.allocate("a", prompt, [], True)
    machine.release(first, True, 30)
    machine.the_pool_tensor_holds_the_simulated_kv()
    machine.demote(6)
    half = [2] * (NUM_BLOCKS // 2 * BLOCK_SIZE)  # two sessions' worth of the whole pool: every cached block goes
    evictors = [machine.allocate(owner, [], half, False) for owner in ("a", "c")]
    for evictor in evictors:
        machine.release(evictor, False, 0)
    assert machine.ledger.pool.num_cached == 0
    second = machine.allocate("b", prompt, [2], True)
    assert machine.promoted == 2 * BLOCK_SIZE
    machine.every_live_sequence_reads_its_own_tokens()
    machine.ledger.release("b", second)
    machine.teardown()
