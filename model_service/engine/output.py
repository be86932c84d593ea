"""Output processing: what a request's stream receives, built from sampled tokens.

A request has n completions (`Completion`), each with its own sequence, detokenizer,
generator and stop matching; `RequestOutput` holds them together with what belongs to
the request once: its sink, its prompt logprobs and its usage. Plain Python on the
engine thread: the tensors behind logprobs are turned into `TokenLogprob` values by
`logprobs.token_logprobs` before they get here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import torch

from model_service.text.detokenizer import IncrementalDetokenizer
from model_service.sample.params import SamplingOptions
from model_service.sample.sampler import make_generator
from model_service.engine.deltas import Delta, Sink
from model_service.sample.logprobs import TokenLogprob
from model_service.sched.step import Finished
from model_service.sched.sequence import Finish, Sequence


def completion_seed(seed: int | None, index: int) -> int | None:
    """Completion i's seed, from (seed, i): completion 0 keeps the request's seed, so n = 1
    draws exactly as before; the others are spread by a 64-bit odd constant (golden ratio)."""
    if seed is None:
        return None
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


@dataclass(eq=False, slots=True)
class Completion:
    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None: the request asked for token ids only
    generator: torch.Generator | None
    request: RequestOutput
    history_slot: int | None = None  # its TokenHistory row, once it samples with a penalty
    grammar: object | None = None  # its xgrammar GrammarMatcher, once it samples under structured output
    suppressed: tuple[int, ...] | None = None  # what min_tokens forbids it, once it samples under min_tokens
    last_token_at: float = 0.0
    finished: bool = False
    # Tokens not sent yet: fewer than the request's stream_interval since the last message, or all (no streaming).
    held: Delta | None = None
    # Tokens of this step's verification still to come after the one being emitted: a stop
    # string matched before them ends the completion, and they are not part of it.
    still_to_emit: int = 0

    def on_token(self, token: int, logprob: TokenLogprob | None, ended: Finished | None) -> Delta:
        """The delta of a token the scheduler has appended (`ended`: whether and why that
        ended the completion); a stop string matched in its text ends it too, and is
        what the delta then reports."""
        finish, matched = (ended.reason, ended.stop_token) if ended is not None else (None, None)
        text, stopped = "", False
        if self.detokenizer is not None:
            pushed = self.detokenizer.push([token])
            text, stopped = pushed.text, pushed.stopped
            if stopped:
                finish, matched = Finish.STOP, pushed.matched
            elif finish is not None:
                text += self.detokenizer.flush()
        delta = Delta(token_ids=[token], text=text, finish=finish, index=self.index, matched_stop=matched)
        if logprob is not None:
            delta.logprobs.append(logprob)
        return delta


@dataclass(eq=False, slots=True)
class RequestOutput:
    """One request: its n completions and what they share."""

    key: int
    request_id: str
    sink: Sink
    options: SamplingOptions
    prompt_len: int
    submitted_at: float
    deadline: float | None  # time.monotonic() by which the request must end, or None
    completions: list[Completion] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_delta_sent: bool = False
    unfinished: int = 0
    cached_tokens: int = 0
    cached_tokens_tiers: tuple[int, int, int] = (0, 0, 0)
    bytes_per_block: int = 0  # of the pool it runs on: Usage.peak_kv_bytes
    tenant: str = ""  # whose (--api-keys; "": no tenant): its id is unique among that tenant's live ones

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.options.prompt_logprobs is not None

    @property
    def prompt_logprobs_done(self) -> bool:
        return len(self.prompt_logprobs) >= self.prompt_len - 1

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def first(self, delta: Delta) -> Delta:
        """Stamps the stream's first delta with the prompt logprobs."""
        if not self.first_delta_sent:
            self.first_delta_sent = True
            if self.wants_prompt_logprobs:
                delta.prompt_logprobs = list(self.prompt_logprobs)
        return delta

    def finished(self, completion: Completion, finish: Finish, delta: Delta | None = None,
                 error: tuple[grpc.StatusCode, str] | None = None) -> Delta:
        """The last delta of a completion. Usage: each completion's own completion_tokens,
        peak KV blocks and recomputed tokens; prompt_tokens and cached_tokens only in the
        request's last one, so that summing the usage of the n last messages counts the
        prompt once."""
        completion.finished = True
        self.unfinished -= 1
        delta = delta or Delta(index=completion.index)
        delta.finish = finish
        delta.error = error
        seq = completion.seq
        delta.completion_tokens = seq.num_output - completion.still_to_emit
        delta.peak_kv_blocks = seq.peak_blocks
        delta.peak_kv_bytes = seq.peak_blocks * self.bytes_per_block
        delta.recomputed_tokens = seq.recomputed_tokens
        delta.spec_proposed_tokens = seq.spec_proposed
        delta.spec_accepted_tokens = seq.spec_accepted
        if self.unfinished == 0:
            delta.prompt_tokens = self.prompt_len
            delta.cached_tokens = self.cached_tokens
            delta.cached_tokens_tiers = self.cached_tokens_tiers
        return self.first(delta)


def new_request(key: int, request_id: str, prompt_token_ids: list[int], options: SamplingOptions, sink: Sink,
                tokenizer, device: torch.device, deadline: float | None, priority: int,
                arrival: int, cache_salt: str = "", bytes_per_block: int = 0, tenant: str = "",
                lora: object | None = None) -> RequestOutput:
    """A request and its n completions' sequences; completion 0's sequence prefills the
    prompt, the others wait to fork from it (Sequence.fork_children)."""
    request = RequestOutput(key=key, request_id=request_id, sink=sink, options=options,
                            prompt_len=len(prompt_token_ids), submitted_at=time.perf_counter(),
                            deadline=deadline, unfinished=options.n, bytes_per_block=bytes_per_block,
                            tenant=tenant)

    def sequence(index: int, **more) -> Sequence:
        return Sequence(request_id=request_id, token_ids=list(prompt_token_ids), prompt_len=len(prompt_token_ids),
                        options=options, arrival=arrival, index=index, priority=priority,
                        cache_salt=cache_salt, tenant=tenant, lora=lora, **more)  # forks inherit the salt at the cache service too

    children = [sequence(index) for index in range(1, options.n)]
    # Prompt logprobs need every prompt position computed, not found in the prefix cache.
    seqs = [sequence(0, fork_children=children, reuse_prefix=not request.wants_prompt_logprobs), *children]
    for index, seq in enumerate(seqs):
        generator = None if options.greedy else make_generator(completion_seed(options.seed, index), device)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, options.stop,
                                             include_stop_str=options.include_stop_str_in_output,
                                             skip_special_tokens=options.skip_special_tokens,
                                             ) if options.detokenize else None
        request.completions.append(Completion(index, seq, detokenizer, generator, request))
    return request
