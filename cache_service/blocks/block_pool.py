"""The physical KV block pool: blocks, ref counts, the free list and the prefix cache.

Pure bookkeeping: nothing here touches a tensor. Sequences and owners live one layer up,
in ``core/ledger.py``; this module only knows blocks.

A block is in exactly one of three states:
- leased: ``ref_count > 0`` (it may also be registered in the prefix cache, if it holds a
  full block some sequence released with ``cache_prefix`` or got from a prefix hit);
- cached: ``ref_count == 0`` and registered: its K/V is still valid and can be revived;
- free: ``ref_count == 0`` and not registered.

Cached and free blocks share one free list, a doubly linked list threaded through the
block objects (as vLLM v1's ``FreeKVCacheBlockQueue``): allocation pops from the head,
freed blocks go to the tail, so cached blocks are evicted least recently freed first,
and reviving a cached block from the middle is O(1) and allocates nothing. Eviction is
lazy: a cached block keeps its hash entry until the moment it is taken for reuse.

A block that has never been leased has no object. At start-up the whole free list is the
range of ids [0, num_blocks) in order, and nothing is ever put in front of it (freed blocks
go to the tail), so the free list is always "the never-leased ids from ``_next_fresh`` up,
then the linked list": ``take`` gives out never-leased ids first, making their objects
then. A pool of 10 million blocks is built in microseconds and holds no memory per block
until blocks are used (a Block object is a small fixed size; docs/benchmark-log.md, "Block pool").

The whole-pool check of all this (``check_invariants``) is block_pool_invariants.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from cache_service.blocks.block_pool_invariants import check_pool
from cache_service.blocks.prefix_hash import DEFAULT_NAMESPACE, HashFn, Namespace, namespace_root


class Block:
    """One physical block. All of them exist from start-up and are never replaced.

    ``parent_reg``/``reg_id`` make prefix hits exact even under hash collisions: every
    registration gets a fresh ``reg_id``, and a block records the ``reg_id`` of the block
    that preceded it when it was registered. A hit must match the stored token ids and
    the identity of the block matched just before it, so by induction a hit chain holds
    exactly the queried tokens, whatever the hash function does. The first block of a
    chain (``parent_reg == 0``) also records its ``namespace``, so a hit never crosses
    from one model or salt into another, whatever the hash function does.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent_reg", "reg_id", "namespace",
                 "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set only while registered in the prefix cache
        self.token_ids: tuple[int, ...] | None = None
        self.parent_reg = 0
        self.reg_id = 0
        self.namespace: Namespace = DEFAULT_NAMESPACE
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        state = "leased" if self.ref_count else ("cached" if self.block_hash is not None else "free")
        return f"Block({self.block_id}, ref_count={self.ref_count}, {state})"


class _Blocks:
    """``pool.blocks``: every block by id, made when first asked for (see the module docstring)."""

    __slots__ = ("_made", "_count")

    def __init__(self, count: int) -> None:
        self._made: dict[int, Block] = {}
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._count:
                raise IndexError(f"block {block_id} is not in a pool of {self._count}")
            block = self._made[block_id] = Block(block_id)
        return block

    def __iter__(self):
        return (self[block_id] for block_id in range(self._count))

    @property
    def made(self) -> int:
        """How many block objects exist (the rest have never been asked for)."""
        return len(self._made)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens, with ref counts and a prefix cache.

    The caller (the ledger) checks ``num_free`` before ``take`` and ``acquire``; these
    methods trust it, so that a refused request never changes anything.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = hash) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.blocks = _Blocks(num_blocks)
        # The free list's head: ids from here up were never leased (no object yet), in order.
        self._next_fresh = 0
        # Then the linked list of blocks freed since, between sentinels at both ends, so
        # linking and unlinking never test for None.
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = num_blocks  # blocks in the free list: plain free + cached
        self.num_cached = 0  # blocks in the free list that are still registered
        self.cached: dict[int, Block] = {}  # block hash -> registered block (leased or cached)
        self._last_reg_id = 0

    # ---------------------------------------------------------------- counts

    @property
    def num_leased(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_plain_free(self) -> int:
        return self.num_free - self.num_cached

    # ---------------------------------------------------------------- leasing

    def take(self, count: int) -> list[Block]:
        """Pop ``count`` blocks from the head of the free list, evicting cached ones.

        Each comes back with ``ref_count == 1``. The caller has checked ``count <= num_free``.
        """
        if count <= 0:
            return []
        if count > self.num_free:
            raise AssertionError(f"take({count}) with only {self.num_free} blocks in the free list")
        taken = []
        if self._next_fresh < self.num_blocks:  # the head of the free list: never-leased ids, in order
            start = self._next_fresh
            fresh = min(count, self.num_blocks - start)
            blocks = self.blocks
            taken = [blocks[block_id] for block_id in range(start, start + fresh)]
            for block in taken:
                block.ref_count = 1
            self._next_fresh = start + fresh
            self.num_free -= fresh
            count -= fresh
            if not count:
                return taken
        head = self._head
        block = head.next
        append = taken.append
        for _ in range(count):
            if block.block_hash is not None:  # lazy eviction: its prefix entry dies only now
                del self.cached[block.block_hash]
                block.block_hash = None
                block.token_ids = None
                self.num_cached -= 1
            block.ref_count = 1
            append(block)
            block = block.next
        # Unlink the whole taken run at once.
        head.next = block
        block.prev = head
        self.num_free -= count
        return taken

    def acquire(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (sharing), reviving cached ones out of the free list."""
        for block in blocks:
            if block.ref_count == 0:
                if block.block_hash is None:
                    raise AssertionError(f"acquire of {block!r}: only leased or cached blocks can be shared")
                prev, nxt = block.prev, block.next
                prev.next = nxt
                nxt.prev = prev
                self.num_free -= 1
                self.num_cached -= 1
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> int:
        """Drop one reference from each block, last block first.

        Blocks reaching zero go to the free-list tail in that order, so a sequence's tail
        blocks are evicted before its head blocks (the head is the likelier shared prefix).
        Returns how many blocks reached zero.
        """
        tail = self._tail
        last = tail.prev
        freed = 0
        cached = 0
        for block in reversed(blocks):
            ref_count = block.ref_count - 1
            if ref_count > 0:
                block.ref_count = ref_count
                continue
            if ref_count < 0:
                # Fix the links before raising, so the pool stays consistent.
                last.next = tail
                tail.prev = last
                self.num_free += freed
                self.num_cached += cached
                raise AssertionError(f"free of {block!r}: ref count would go below zero")
            block.ref_count = 0
            last.next = block
            block.prev = last
            last = block
            freed += 1
            if block.block_hash is not None:
                cached += 1
        last.next = tail
        tail.prev = last
        self.num_free += freed
        self.num_cached += cached
        return freed

    # ---------------------------------------------------------------- prefix cache

    def lookup(self, token_ids: Sequence[int], max_blocks: int, namespace: Namespace = DEFAULT_NAMESPACE) -> list[Block]:
        """The registered blocks of ``namespace`` holding the longest prefix of ``token_ids``,
        up to ``max_blocks``.

        Only full blocks match. References are not taken: pass the result to ``acquire``.
        """
        block_size = self.block_size
        max_blocks = min(max_blocks, len(token_ids) // block_size)
        if max_blocks <= 0 or not self.cached:
            return []
        tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
        cached_get = self.cached.get
        hash_fn = self.hash_fn
        parent_hash = namespace_root(namespace, hash_fn)
        parent_reg = 0
        hits: list[Block] = []
        append = hits.append
        start = 0
        for _ in range(max_blocks):
            chunk = tokens[start : start + block_size]
            parent_hash = hash_fn((parent_hash, chunk))
            block = cached_get(parent_hash)
            # Verify: a colliding hash must not return another prefix's blocks.
            if block is None or block.parent_reg != parent_reg or block.token_ids != chunk:
                break
            if parent_reg == 0 and block.namespace != namespace:
                break
            append(block)
            parent_reg = block.reg_id
            start += block_size
        return hits

    def register(self, blocks: Sequence[Block], token_ids: Sequence[int],
                 namespace: Namespace = DEFAULT_NAMESPACE, elsewhere: Callable[[int], object] | None = None) -> int:
        """Register the full blocks of a sequence holding ``token_ids`` in ``namespace``'s prefix cache.

        ``blocks[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``. When an
        identical block is already registered, that one stays the cached copy and
        ``blocks[i]`` is left as it is (it becomes plain free when released). Registration
        stops at the first block that cannot be registered (a hash collision with another
        prefix, or a block already registered with other contents), since nothing after it
        could be found. Returns how many blocks were newly registered.

        ``elsewhere`` (the KV tiers' index, when there are tiers) is asked for a hash the
        pool does not hold: an entry of the same identity (parent, tokens, namespace) lends
        the block its ``reg_id``, so chains that continue in a tier still match; an entry of
        another identity is a collision and stops registration, as in the pool.
        """
        block_size = self.block_size
        count = min(len(token_ids) // block_size, len(blocks))
        if count <= 0:
            return 0
        tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
        cached = self.cached
        hash_fn = self.hash_fn
        parent_hash = namespace_root(namespace, hash_fn)
        parent_reg = 0
        registered = 0
        for index in range(count):
            chunk = tokens[index * block_size : (index + 1) * block_size]
            parent_hash = hash_fn((parent_hash, chunk))
            block = blocks[index]
            canonical = cached.get(parent_hash)
            if canonical is None:
                if block.block_hash is not None or block.ref_count == 0:
                    break  # registered under another hash: it holds other tokens than claimed
                other = elsewhere(parent_hash) if elsewhere is not None else None
                if other is None:
                    self._last_reg_id += 1
                    reg_id = self._last_reg_id
                elif (other.parent_reg != parent_reg or other.token_ids != chunk
                      or (parent_reg == 0 and other.namespace != namespace)):
                    break  # hash collision with a block kept in a tier
                else:
                    reg_id = other.reg_id
                block.block_hash = parent_hash
                block.token_ids = chunk
                block.parent_reg = parent_reg
                block.reg_id = reg_id
                block.namespace = namespace
                cached[parent_hash] = block
                registered += 1
            elif canonical.parent_reg != parent_reg or canonical.token_ids != chunk:
                break  # hash collision with a different prefix
            elif parent_reg == 0 and canonical.namespace != namespace:
                break  # hash collision with another namespace's first block
            parent_reg = canonical.reg_id if canonical is not None else block.reg_id
        return registered

    def adopt(self, block: Block, block_hash: int, token_ids: tuple[int, ...], parent_reg: int, reg_id: int,
              namespace: Namespace) -> None:
        """Register a leased block whose contents were just copied in from a KV tier, under
        the identity the tier kept (a promotion): the chain through it matches as before."""
        if block.ref_count == 0 or block.block_hash is not None or block_hash in self.cached:
            raise AssertionError(f"adopt of {block!r} under hash {block_hash}: only an unregistered leased block "
                                 "and a hash the pool does not hold")
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_reg = parent_reg
        block.reg_id = reg_id
        block.namespace = namespace
        self.cached[block_hash] = block

    def drop_cached(self, fingerprint: str | None = None) -> tuple[list[Block], int]:
        """Unregisters every cached block (registered, held by no sequence) of the model
        ``fingerprint`` (None: of every model); leased blocks keep their registration.

        The dropped blocks become plain free and move to the front of the linked free list
        (behind the never-leased ids, which are plain free too), so allocations take them
        before evicting any block still cached. Returns (the blocks dropped, how many
        registered blocks of the model were kept because they are leased).
        """
        dropped: list[Block] = []
        kept = 0
        cached = self.cached
        head = self._head
        for block_hash, block in list(cached.items()):
            if fingerprint is not None and block.namespace[0] != fingerprint:
                continue
            if block.ref_count:
                kept += 1
                continue
            del cached[block_hash]
            block.block_hash = None
            block.token_ids = None
            prev, nxt = block.prev, block.next  # to the front of the linked free list
            prev.next = nxt
            nxt.prev = prev
            first = head.next
            head.next = block
            block.prev = head
            block.next = first
            first.prev = block
            dropped.append(block)
        self.num_cached -= len(dropped)
        return dropped, kept

    def new_reg_id(self) -> int:
        """A registration id no block has had (the tiers number what they load from disk)."""
        self._last_reg_id += 1
        return self._last_reg_id

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken pool invariant (block_pool_invariants.py)."""
        check_pool(self)
