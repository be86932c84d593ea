"""One engine step's sampling: which rows, which adjustments, which logprobs.

The engine hands over the sequences whose next token is due and their logits; this
picks the rows (the first token of an n-request's completion 0 is also its other
completions' first-token row), builds the logits adjustments only when a row uses one,
samples, and computes the raw logprobs the rows asked for. It also collects prompt
logprobs from the prefill chunks that need them. It owns the device-side token history
the penalties read; the engine owns the requests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence as Seq

import torch

from model_service.device_copies import to_device, to_host
from model_service.sample.grammar import TokenMasks, accept, new_matcher
from model_service.sample.logits_processing import RowAdjustment, TokenHistory, prepare
from model_service.sample.logprobs import logprob_tensors, read_logprobs, token_logprobs
from model_service.sample.logprobs import TokenLogprob
from model_service.engine.output import Completion
from model_service.sample.sampler import sample
from model_service.sched.sequence import Sequence


class StepSampler:
    def __init__(self, vocab_size: int, eos_token_ids: Collection[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.history: TokenHistory | None = None  # made when a request first needs a penalty
        self.masks = TokenMasks(vocab_size, device)

    def sample(self, due: list[Sequence], logits: torch.Tensor, completions: Mapping[Sequence, Completion],
               ) -> tuple[list[Completion], list[int], list[TokenLogprob | None]]:
        """Next tokens of the due sequences (and of the completions that fork from them at
        this step): (completions, their tokens, their logprobs or None), in row order."""
        forking = [seq for seq in due if seq.fork_children and seq.num_output == 0]
        if forking:
            # Each child samples its first token from a copy of its parent's row, right after it.
            rows, ordered = [], []
            for row, seq in enumerate(due):
                family = [seq, *seq.fork_children] if seq.fork_children and seq.num_output == 0 else [seq]
                rows.extend([row] * len(family))
                ordered.extend(family)
            logits = logits.index_select(0, to_device(rows, torch.int64, logits.device))
            due = ordered
        chosen = [completions[seq] for seq in due]
        options = [completion.seq.options for completion in chosen]
        adjustments = None
        if any(o.adjusts_logits for o in options):  # else the plain sampler: greedy is one argmax
            adjustments = prepare([self._adjustment(c) for c in chosen], logits.device)
        matchers = None
        if any(o.grammar is not None for o in options):  # else no row pays for structured output
            matchers = [self._matcher(c) for c in chosen]
        mask = self.masks.prepare(matchers) if matchers else None
        token_tensor = sample(logits, options, [c.generator for c in chosen], adjustments, self.history, mask)
        # The logprobs asked for are computed before anything is read back, and come back
        # with the tokens: the step's one wait for the device.
        asked = [row for row, o in enumerate(options) if o.logprobs is not None]
        tops = [options[row].logprobs for row in asked]
        found: list[torch.Tensor] = []
        if asked:
            if len(asked) == len(options):
                found = logprob_tensors(logits, token_tensor, tops)
            else:
                index = to_device(asked, torch.int64, logits.device)
                found = logprob_tensors(logits.index_select(0, index),
                                        token_tensor.to(logits.device).index_select(0, index), tops)
        host_tokens, *found = to_host(token_tensor, *found)
        tokens = host_tokens.tolist()
        if matchers:
            accept(matchers, tokens)
        logprobs: list[TokenLogprob | None] = [None] * len(chosen)
        if asked:
            for row, logprob in zip(asked, read_logprobs([tokens[row] for row in asked], found, tops)):
                logprobs[row] = logprob
        counted = [(c.history_slot, token) for c, token in zip(chosen, tokens) if c.history_slot is not None]
        if counted:
            self.history.record([slot for slot, _ in counted], [token for _, token in counted])
        return chosen, tokens, logprobs

    def release(self, completion: Completion) -> None:
        """A completion ended: its token history row is free again."""
        completion.grammar = None
        if completion.history_slot is not None:
            self.history.close(completion.history_slot)
            completion.history_slot = None

    def _matcher(self, completion: Completion):
        options = completion.seq.options
        if options.grammar is None:
            return None
        if completion.grammar is None:
            # At its first token (a fork's too: it samples from its parent's first row, at the
            # grammar's start). A preempted sequence keeps its tokens, so its matcher stays right.
            completion.grammar = new_matcher(options.grammar, self.eos_token_ids | options.stop_token_ids)
        return completion.grammar

    def reset(self) -> None:
        """Every request is gone (the cache service was lost)."""
        self.history = None

    def _adjustment(self, completion: Completion) -> RowAdjustment | None:
        seq = completion.seq
        options = seq.options
        if not options.adjusts_logits:
            return None
        if options.uses_history and completion.history_slot is None:
            if self.history is None:
                self.history = TokenHistory(self.vocab_size, self.device)
            # At its first token: the history holds the prompt (seen) and no counts.
            completion.history_slot = self.history.open(seq.token_ids)
        suppressed: tuple[int, ...] = ()
        if seq.num_output < options.min_tokens:
            if completion.suppressed is None:
                # Built once per completion, not on every step, and dropped with it: a
                # cache across requests would keep each distinct stop set (up to the
                # whole vocabulary) alive after its request.
                eos = frozenset() if options.ignore_eos else self.eos_token_ids
                completion.suppressed = tuple(sorted(options.stop_token_ids | eos))
            suppressed = completion.suppressed
        return RowAdjustment(
            history_slot=completion.history_slot, repetition_penalty=options.repetition_penalty,
            presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
            logit_bias=options.logit_bias, suppressed_token_ids=suppressed,
        )

    # -- prompt logprobs ---------------------------------------------------------------

    @staticmethod
    def prompt_logits_wanted(batch: Seq[tuple[Sequence, int]],
                             completions: Mapping[Sequence, Completion]) -> dict | None:
        """The runner's `prompt_logits` argument for this batch, or None when no
        prefill chunk in it has prompt logprobs to compute."""
        wanted = None
        for seq, _ in batch:
            if seq.index == 0 and not seq.reuse_prefix and seq.num_computed < seq.prompt_len - 1:
                completion = completions.get(seq)
                if completion is not None and not completion.request.prompt_logprobs_done:
                    wanted = wanted or {}
                    wanted[seq] = None
        return wanted

    @staticmethod
    @torch.inference_mode()
    def collect_prompt_logprobs(prompt_logits: dict, completions: Mapping[Sequence, Completion],
                                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[Sequence]:
        """Appends the logprobs of the prompt positions this step computed (the runner's
        hidden rows, turned into logits here PROMPT_LOGPROB_ROWS at a time, so the memory
        it takes is bounded whatever the chunk) to their requests; returns the sequences
        whose prompt logprobs are now complete."""
        done: list[Sequence] = []
        for seq, (start, hidden) in prompt_logits.items():
            request = completions[seq].request
            # Entry i is prompt token i + 1's; after a preemption the recompute passes
            # positions already collected.
            skip = max(len(request.prompt_logprobs) - start, 0)
            if skip >= hidden.shape[0]:
                continue
            for first in range(skip, hidden.shape[0], PROMPT_LOGPROB_ROWS):
                last = min(first + PROMPT_LOGPROB_ROWS, hidden.shape[0])
                targets = to_device(seq.token_ids[start + 1 + first:start + 1 + last], torch.int64, hidden.device)
                request.prompt_logprobs.extend(token_logprobs(
                    compute_logits(hidden[first:last]), targets, [request.options.prompt_logprobs] * len(targets)))
            if request.prompt_logprobs_done:
                done.append(seq)  # a recompute may take cached blocks again
        return done


# Prompt positions turned into logits at once: 256 rows at vocab 49,152 are 50 MB of
# float32, where a whole 2,048-token chunk was 400 MB (and its peak more).
PROMPT_LOGPROB_ROWS = 256
