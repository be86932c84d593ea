"""The blocks a rejected proposal leaves a speculating sequence holding past its need.

A proposal runs in blocks the sequence holds, and the lease call that goes out with its
step extends the table as if the whole proposal will be kept. When part of it is
rejected, whole blocks past the sequence's next tokens may hold only rejected positions
(or nothing): with a cache service that applies TruncateOp they go back in the next
lease call, instead of waiting, leased, for the tokens that reach them. A sequence
keeps what a one-token decode would hold: its next token's slot and the one after (as
an extend asks), and its blocks ahead while top-ups run (lease_ahead.py).
"""

from __future__ import annotations

from model_service.sched.lease_ahead import ahead_target
from model_service.sched.lease_ops import blocks_for
from model_service.sched.sequence import Sequence


def truncation(seq: Sequence, block_size: int, lookahead_tokens: int, max_model_len: int) -> int | None:
    """The tokens `seq`'s table is cut to after a verification that rejected tokens, or
    None when it holds no whole block past them. `lookahead_tokens`: 0 when no top-up runs."""
    tokens = seq.num_computed + 2
    if lookahead_tokens:
        tokens = max(tokens, ahead_target(seq, lookahead_tokens, max_model_len))
    return tokens if len(seq.block_table) > blocks_for(tokens, block_size) else None
