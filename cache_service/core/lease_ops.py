"""A Lease call's ops as plain records, and each applied to the ledger with a typed outcome.

The servicer decodes the wire's LeaseOps into these (api/wire.py) and KvPool.lease applies
them in order; each outcome names the sequence it is about, so mapping it back to a
LeaseResult needs nothing but the outcome. A refused op is a ``Refused`` outcome and
touches nothing else: the other ops of the call go on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.core.ledger import Allocation, Fork, InvalidLease, Ledger, LeaseError

# A salt is a tenant key: short. Each live sequence keeps its salt.
MAX_SALT_CHARS = 256
# A LoRA adapter's name as the model service accepts it (model_service/lora/registry.py).
MAX_LORA_NAME_CHARS = 128


@dataclass(frozen=True, slots=True)
class AllocateOp:
    num_tokens: int
    prompt_token_ids: Sequence[int] = ()
    cache_salt: str = ""
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class ExtendOp:
    sequence_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ForkOp:
    sequence_id: int
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseOp:
    sequence_id: int
    cache_prefix: bool = False
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class CommitOp:
    sequence_id: int
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class TruncateOp:
    sequence_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class EmptyOp:
    """A LeaseOp with none of its kinds set."""


LeaseOp = AllocateOp | ExtendOp | ForkOp | ReleaseOp | CommitOp | TruncateOp | EmptyOp


@dataclass(frozen=True, slots=True)
class Extended:
    sequence_id: int
    block_ids: list[int]  # only the blocks appended


@dataclass(frozen=True, slots=True)
class Released:
    """A release's or a truncate's: the blocks it gave back."""

    sequence_id: int
    blocks_released: int


@dataclass(frozen=True, slots=True)
class Committed:
    sequence_id: int
    blocks_committed: int


@dataclass(frozen=True, slots=True)
class Refused:
    sequence_id: int  # the op's sequence; 0 for an allocate or an empty op
    error: LeaseError


LeaseOutcome = Allocation | Extended | Fork | Released | Committed | Refused


def apply_op(ledger: Ledger, owner: str, op: LeaseOp, model_fingerprint: str = "") -> LeaseOutcome:
    """Applies one op of ``owner``'s (a session serving ``model_fingerprint``)."""
    try:
        kind = type(op)
        if kind is AllocateOp:
            if len(op.cache_salt) > MAX_SALT_CHARS:
                raise InvalidLease(f"cache_salt is {len(op.cache_salt)} characters; at most {MAX_SALT_CHARS}")
            if len(op.lora_name) > MAX_LORA_NAME_CHARS or not op.lora_name.isprintable():
                raise InvalidLease(f"lora_name must be at most {MAX_LORA_NAME_CHARS} printable characters")
            return ledger.allocate(owner, op.num_tokens, op.prompt_token_ids, (model_fingerprint, op.cache_salt),
                                   op.lora_name)
        if kind is ExtendOp:
            return Extended(op.sequence_id, ledger.extend(owner, op.sequence_id, op.num_tokens))
        if kind is ForkOp:
            return ledger.fork(owner, op.sequence_id, op.num_tokens)
        if kind is ReleaseOp:
            return Released(op.sequence_id, ledger.release(owner, op.sequence_id, op.cache_prefix, op.token_ids))
        if kind is CommitOp:
            return Committed(op.sequence_id, ledger.commit(owner, op.sequence_id, op.token_ids))
        if kind is TruncateOp:
            return Released(op.sequence_id, ledger.truncate(owner, op.sequence_id, op.num_tokens))
        raise InvalidLease("empty lease op: set one of allocate, extend, fork, release, commit, truncate")
    except LeaseError as error:
        return Refused(getattr(op, "sequence_id", 0), error)
