"""What a Scheduler may do in one step and how it orders its sequences: its settings,
checked once when it is made (the engine builds them from the service's flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    block_size: int
    # Sequences running or being admitted at once.
    max_num_seqs: int
    # Tokens through the model in one step: one per decoding sequence plus prefill chunks.
    max_batch_tokens: int
    # How far ahead of its next token a decoding sequence is leased by top-ups; 0: never.
    lookahead_tokens: int = 0
    # No sequence grows past this many tokens (the engine ends it there); 0: no limit.
    max_model_len: int = 0
    # How long the release of a sequence that finished normally may wait for a call that
    # goes out anyway, while others run and nobody waits for blocks; 0: the next step's.
    release_hold_s: float = 0.0
    # Prefill tokens a step carries beside decoding sequences, unless more prompts wait for
    # their first token than sequences decode; 0: max_batch_tokens alone bounds them. Every
    # decoding stream waits for the whole step, so a prompt's chunk is what each of them
    # waits for once more: a long prompt is cut into short steps.
    max_prefill_tokens_while_decoding: int = 0
    # Prompts being computed go shortest first, each step a prompt has waited counting as
    # this many of its tokens done: only prompts ready within (its tokens left) / this
    # steps after it can overtake it (bench/engine/sched_sim.py chose 8: fewer is shortest first
    # with no bound, more is first come, first chunked).
    prefill_aging_tokens: int = 8
    # A waiting prompt whose leading full blocks (at least this many tokens of them)
    # another sequence is computing waits for them to be committed, then finds them cached
    # (inflight_prefixes.py); 0: admitted at once, computing them again.
    prefix_hold_min_tokens: int = 32
    # The cache service applies TruncateOp: the blocks a rejected proposal leaves past a
    # speculating sequence's need go back at once (spec_tails.py); else they wait, leased.
    truncate_tables: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_batch_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("lookahead_tokens", "max_model_len", "release_hold_s", "max_prefill_tokens_while_decoding",
                     "prefill_aging_tokens", "prefix_hold_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")


POLICIES = ("fcfs", "priority")
