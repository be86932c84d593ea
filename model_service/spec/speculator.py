"""Which decoding sequences speculate this step, and with what proposal: ngram looks up the
sequence's own tokens (ngram.py); suffix takes the likelier of a proposal from its own
tokens (request_trie.py) and one from the outputs of its tenant's earlier requests
(suffix.py), which it is told of as they end (`finished`).

The scheduler asks `propose` for each decoding sequence; a sequence that gets tokens runs
them beside its last token as decode rows of the step, in the blocks it already holds: a
proposal never asks the cache service for a block, and a rejected tail is rolled back by
the scheduler (num_computed), so its slots are written over later and never committed to
the prefix cache nor released as cached tokens.

Greedy and sampled sequences speculate (temperature, top-k/p, min_p, seeds: each
proposed position's row is drawn as one-token steps draw it, spec/verify.py). Penalties,
logit_bias and min_tokens would need the token counts advanced over each proposed
position, a grammar its matcher, and logprobs a row of their own per kept token: such
requests decode one token a step, with the same output as ever.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from model_service import metrics
from model_service.sched.sequence import Sequence
from model_service.spec.adaptive import ProposalState, row_chances
from model_service.spec.ngram import NgramIndex
from model_service.spec.pays import SpeculationPays
from model_service.spec.request_trie import RequestTrie
from model_service.spec.settings import SpeculativeSettings
from model_service.spec.step_costs import StepCosts
from model_service.spec.suffix import SuffixHistory

# A sequence whose proposals are accepted less often than this, once it has had
# LOW_ACCEPTANCE_AFTER tokens proposed, stops speculating: each rejected token costs a
# query row in every step it is proposed in.
LOW_ACCEPTANCE = 0.2
LOW_ACCEPTANCE_AFTER = 32
# A sequence's index of its own tokens holds at most twice this many (an ngram index takes
# an entry per token and lookup length, a suffix trie up to its depth in nodes per token):
# a long prompt's index is over its last tokens, the likeliest to be quoted next.
OWN_TEXT_WINDOW = 1024


class Speculator:
    def __init__(self, settings: SpeculativeSettings, block_size: int, max_model_len: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.max_model_len = max_model_len
        # Each sequence's own tokens from a position on: an ngram index (ngram), a suffix trie
        # (suffix: request_trie.py); `_own_index` keeps them up to date and bounded.
        self._indexes: weakref.WeakKeyDictionary[Sequence, tuple[int, NgramIndex | RequestTrie]] = \
            weakref.WeakKeyDictionary()
        # --speculative-max-tokens: each sequence's proposal length and counts (spec/adaptive.py).
        self._states: weakref.WeakKeyDictionary[Sequence, ProposalState] = weakref.WeakKeyDictionary()
        # --speculative-method suffix: the outputs of finished requests, by tenant and cache salt.
        self.history = SuffixHistory(settings.prompt_lookup_max + settings.longest,
                                     settings.suffix_cache_tokens) if settings.method == "suffix" else None
        # Decode steps' seconds by their rows, recorded by the engine (`step_took`).
        self.costs = StepCosts()
        # Whole decode steps' tokens a second with and without proposals (`step_done`).
        self.pays = SpeculationPays()

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        options = seq.options
        return (options.speculate and options.grammar is None and options.logprobs is None
                and not options.adjusts_logits and not seq.spec_off
                and not (seq.fork_children and seq.num_output == 0))

    def propose(self, seq: Sequence, spare_tokens: int) -> list[int]:
        """Tokens for `seq` to verify beside its next one (at most `spare_tokens`); []: it decodes as ever."""
        return self._propose(seq, spare_tokens)[0]

    def _propose(self, seq: Sequence, spare_tokens: int) -> tuple[list[int], list[float] | None]:
        """`propose`'s tokens, and with the suffix method each position's share of the
        matched occurrences that went on that way (SuffixTrie.propose_scored); None: no
        shares (the ngram index follows one occurrence)."""
        if not self.eligible(seq):
            return [], None
        room = min(self.length(seq), spare_tokens,
                   # slots its table holds past this step's token: no block is asked for a guess
                   seq.capacity(self.block_size) - seq.num_computed - 1,
                   # tokens it may still append, less the one the verification always gives
                   seq.options.max_new_tokens - seq.num_output - 1)
        if self.max_model_len:
            room = min(room, self.max_model_len - len(seq.token_ids) - 1)
        if room <= 0:
            return [], None
        if self.history is not None:
            return self._propose_suffix(seq, room)
        index = self._own_index(seq, lambda: NgramIndex(self.settings.prompt_lookup_min, self.settings.prompt_lookup_max))
        return index.propose(room), None

    def _own_index(self, seq: Sequence, make):
        """`seq`'s index of its own tokens (made by `make`), brought up to date: over all of
        them while they are at most 2 x OWN_TEXT_WINDOW, else made again over the last
        OWN_TEXT_WINDOW each time it would pass that."""
        tokens = seq.token_ids
        held = self._indexes.get(seq)
        if held is None or len(tokens) - held[0] > 2 * OWN_TEXT_WINDOW:
            start = 0 if len(tokens) <= 2 * OWN_TEXT_WINDOW else len(tokens) - OWN_TEXT_WINDOW
            held = self._indexes[seq] = (start, make())
        start, index = held
        index.extend(tokens[start + index.taken:])
        return index

    def _propose_suffix(self, seq: Sequence, room: int) -> tuple[list[int], list[float]]:
        """The likelier of two proposals, by the tokens each expects kept: from the
        sequence's own prompt and output, and from its namespace's earlier outputs (on a
        tie its own, the text it is writing from)."""
        trie = self._own_index(seq, lambda: RequestTrie(self.history.depth))
        low, high = self.settings.prompt_lookup_min, self.settings.prompt_lookup_max
        own = trie.propose_scored(seq.token_ids, low, high, room)
        theirs = self.history.propose_scored(namespace(seq), seq.token_ids, low, high, room)
        return theirs if sum(theirs[1]) > sum(own[1]) else own

    def length(self, seq: Sequence) -> int:
        """The most tokens `seq` proposes this step: K, or its adapted length."""
        if not self.settings.adaptive:
            return self.settings.num_speculative_tokens
        return self._state(seq).length

    def _state(self, seq: Sequence) -> ProposalState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = ProposalState(self.settings.num_speculative_tokens)
        return state

    def proposals(self, decodes: list[Sequence], budget: int,
                  spare: Callable[[Sequence, int], int]) -> dict[Sequence, list[int]]:
        """What each of `decodes` proposes this step, cut to the proposed rows worth verifying
        (at most `budget`; `spare(seq, most)`: the tokens `seq`'s tenant may still take of
        `most`): as many as make the step's tokens a second the most, by the measured cost of
        steps of each size (spec/step_costs.py). With a fixed K, the server's share kept sets
        how many, and the sequences first in line take them; with adaptive lengths, every
        sequence proposes first and the likeliest positions are kept (spec/adaptive.py)."""
        if self.settings.adaptive:
            proposed, shares = {}, {}
            for seq in decodes:
                proposal, proposal_shares = self._propose(seq, spare(seq, budget))
                if proposal:
                    proposed[seq] = proposal
                    if proposal_shares is not None:
                        shares[seq] = proposal_shares
            return self.trim(len(decodes), budget, proposed, shares)
        allowance = self.allowance(len(decodes), budget)
        proposed = {}
        for seq in decodes:
            room = min(spare(seq, budget), allowance)
            proposal = self.propose(seq, room) if room > 0 else []
            if proposal:
                allowance -= len(proposal)
                budget -= len(proposal)
                proposed[seq] = proposal
        return proposed

    def trim(self, decodes: int, budget: int, proposals: dict[Sequence, list[int]],
             shares: dict[Sequence, list[float]] | None = None) -> dict[Sequence, list[int]]:
        """Of `proposals` (adaptive lengths), the rows a step verifies beside `decodes` decoding
        sequences, at most `budget`: the likeliest positions first (spec/adaptive.py, with
        the proposer's `shares` where it has them), as many as make the step's tokens a
        second the most by its measured cost (spec/step_costs.py), or all that fit with
        --speculative-always."""
        prior = self.costs.continuation
        chances = {seq: self._state(seq).continuation(prior) for seq in proposals}
        rows = row_chances(proposals, chances, shares)[:max(budget, 0)]
        count = len(rows) if self.settings.always else self.costs.rows_worth(decodes, [r[0] for r in rows])
        lengths: dict[Sequence, int] = {}
        for _, seq, position in rows[:count]:
            lengths[seq] = position
        return {seq: proposals[seq][:n] for seq, n in lengths.items()}

    def allowance(self, decodes: int, budget: int) -> int:
        """Proposed rows worth verifying this step beside `decodes` decoding sequences (the
        step's token budget left is `budget`)."""
        most = min(budget, decodes * self.settings.num_speculative_tokens)
        return most if self.settings.always else self.costs.allowance(decodes, most)

    def looks_up(self, decodes: int) -> bool:
        """Whether a step with `decodes` decoding sequences looks up proposals at all: where
        speculating has measured slower than not (spec/pays.py), most steps do not, and pay
        nothing for it; always with --speculative-always."""
        return decodes > 0 and (self.settings.always or self.pays.speculate(decodes))

    def step_took(self, rows: int, seconds: float) -> None:
        """A decode-only step's forward pass (proposed rows included) of `rows` rows took `seconds`."""
        self.costs.record(rows, seconds)

    def step_done(self, decodes: int, looked_up: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `decodes` sequences, which looked up proposals or not,
        appended `tokens` in `seconds` on the engine thread, scheduling to sampling."""
        self.pays.record(decodes, looked_up, tokens, seconds)

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: the suffix proposer keeps its output for its namespace's later requests."""
        if self.history is not None:
            self.history.add(namespace(seq), seq.token_ids[seq.prompt_len:])

    def settle(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Counts a verification; turns speculation off for a sequence that gains too little."""
        metrics.SPEC_PROPOSED.labels(self.settings.method).inc(proposed)
        metrics.SPEC_ACCEPTED.labels(self.settings.method).inc(accepted)
        seq.spec_proposed += proposed
        seq.spec_accepted += accepted
        self.costs.settle(proposed, accepted)
        kept = seq.spec_accepted / max(seq.spec_proposed, 1)
        if self.settings.adaptive:
            state = self._state(seq)
            state.settle(proposed, accepted, self.settings.longest)
            # Long proposals lower the share kept by their tails; what tells whether guessing
            # pays is the chance of each next token being kept.
            kept = state.continuation(0.0)
        if seq.spec_proposed >= LOW_ACCEPTANCE_AFTER and kept < LOW_ACCEPTANCE:
            seq.spec_off = True


def namespace(seq: Sequence) -> tuple[str, str]:
    """Whose outputs a sequence's proposals may come from: its tenant's, under its cache
    salt (a LoRA adapter's namespace is part of the salt)."""
    return seq.tenant, seq.cache_salt
