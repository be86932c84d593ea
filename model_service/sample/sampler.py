"""The batched sampler: one token per row of a logits batch.

`sample` runs first the adjustments of `logits_processing` (penalties, logit_bias,
min_tokens) when some row uses them, then greedy rows by one argmax, sampled rows by
temperature, min_p, top-k and top-p, each drawn with the row's own `torch.Generator`
so that a seeded request gives the same tokens whatever else shares its batch.

On CUDA nothing here makes the host wait for the device: per-row parameters go over
with to_device, and no value is read back. The step's one sync is its caller reading
the tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from model_service.device_copies import to_device
from model_service.sample.grammar import TokenMask
from model_service.sample.logits_processing import LogitsAdjustments, TokenHistory, apply_min_p
from model_service.sample.params import SamplingOptions


# Stands in for a constrained row in the pass over the unconstrained ones: an argmax, discarded.
_AS_GREEDY = SamplingOptions(max_new_tokens=1)


def _sample_masked(logits: torch.Tensor, options: Sequence[SamplingOptions],
                   generators: Sequence[torch.Generator | None], mask: TokenMask) -> torch.Tensor:
    """sample() for a batch with constrained rows: those are gathered into their own float32
    tensor, masked and sampled there; the others are sampled from `logits` as ever, while
    the constrained rows take the cheap greedy path in that pass (their draw is the one from
    the masked copy, and no generator is used twice). Copying only the constrained rows
    keeps a batch with a few of them from paying a copy of the whole [B, V]."""
    rows = mask.rows
    index = to_device(rows, torch.int64, logits.device)
    # [C, V], a new tensor: stacking row views copies them in one pass, where index_select
    # pays a whole-batch parallel region on CPU for a handful of rows.
    constrained = mask.apply(torch.stack([logits[row] for row in rows]).float())
    chosen = sample(constrained, [options[row] for row in rows], [generators[row] for row in rows])
    if len(rows) == len(options):
        return chosen
    rest = set(rows)
    token_ids = sample(logits, [_AS_GREEDY if row in rest else opts for row, opts in enumerate(options)],
                       [None if row in rest else gen for row, gen in enumerate(generators)])
    return token_ids.index_copy_(0, index.to(token_ids.device), chosen.to(token_ids.device))


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator for one request: seeded from `seed`, or from the OS when it is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator.manual_seed(seed)
    return generator


def draw_uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """A sampled row's one draw: each token of a request takes the next uniform of its
    generator. Speculative verification (spec/verify.py) replays this call to leave a
    generator where one-token steps would have left it."""
    return torch.rand((), device=device, generator=generator)


def sample(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions],
    generators: Sequence[torch.Generator | None],
    adjustments: LogitsAdjustments | None = None,
    history: TokenHistory | None = None,
    mask: TokenMask | None = None,
) -> torch.Tensor:
    """One token id per row. logits: [B, V], any float dtype → [B] int64. logits is not
    modified. Every stage that computes with them does so in float32 (adjustments on a
    float32 copy, sampled rows scaled into one); greedy rows need only their argmax, which
    float32 would not change.

    A row's draw depends only on its own logits, options and generator, never on the
    other rows: filtering is row-wise and each row draws with its own generator.
    `adjustments` (penalties, logit_bias, min_tokens; None when no row uses them) come
    first, reading token counts from `history`; then `mask` (structured output: None when
    no row is constrained) sets the tokens a row's grammar forbids to -inf.
    """
    batch, vocab = logits.shape
    if len(options) != batch or len(generators) != batch:
        raise ValueError(
            f"logits has {batch} rows but got {len(options)} options and "
            f"{len(generators)} generators"
        )
    if adjustments is not None:
        logits = adjustments.apply(logits, history)
    if mask is not None:
        return _sample_masked(logits, options, generators, mask)
    sampled_rows = [row for row, opts in enumerate(options) if not opts.greedy]
    # One argmax answers every greedy row; sampled rows overwrite their entries below.
    if len(sampled_rows) < batch:
        token_ids = argmax_rows(logits)  # [B]
        if not sampled_rows:
            return token_ids
    else:
        token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)

    device = logits.device
    every_row = len(sampled_rows) == batch
    rows = None if every_row else to_device(sampled_rows, torch.int64, device)
    sampled = [options[row] for row in sampled_rows]
    temperature = to_device([o.temperature for o in sampled], torch.float32, device)
    chosen = logits if every_row else logits.index_select(0, rows)
    scaled = chosen.float() / temperature.unsqueeze(1)  # [S, V], a new tensor: edited in place
    if any(o.min_p > 0 for o in sampled):
        apply_min_p(scaled, to_device([o.min_p for o in sampled], torch.float32, device).unsqueeze(1))

    # Every step below works row by row (elementwise, or a reduction along V) and keeps
    # vocabulary order, so a row's result does not depend on the rows beside it. Top-k
    # and top-p become thresholds (ties at a threshold are all kept).
    top_ks = [o.top_k if 0 < o.top_k < vocab else 0 for o in sampled]  # 0: no top-k
    if any(top_ks):
        best = torch.topk(scaled, max(top_ks), dim=-1).values  # [S, K], descending
        kth_index = to_device([max(k - 1, 0) for k in top_ks], torch.int64, device).unsqueeze(1)
        has_top_k = to_device([k > 0 for k in top_ks], torch.bool, device).unsqueeze(1)
        # The k-th best logit, or -inf (nothing below it) for rows without top-k: [S, 1]
        threshold = best.gather(1, kth_index).masked_fill_(~has_top_k, float("-inf"))
        scaled.masked_fill_(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    del scaled

    top_p_rows = [index for index, o in enumerate(sampled) if o.top_p < 1.0]
    if top_p_rows:
        all_top_p = len(top_p_rows) == len(sampled)
        top_p_index = to_device(top_p_rows, torch.int64, device)
        top_p = to_device([sampled[i].top_p for i in top_p_rows], torch.float32, device).unsqueeze(1)
        # After top-k, at most max(k) tokens per row have a probability above 0.
        row_ks = [top_ks[i] for i in top_p_rows]
        support = max(row_ks) if all(row_ks) else vocab
        nucleus = _nucleus_threshold(
            probs if all_top_p else probs.index_select(0, top_p_index), top_p, support
        )  # [P, 1]
        if all_top_p:
            threshold = nucleus
        else:  # 0 for rows without top-p: nothing is below it
            threshold = torch.zeros(len(sampled), 1, device=device).index_copy_(0, top_p_index, nucleus)
        probs.masked_fill_(probs < threshold, 0.0)

    # Inverse-CDF draw: one uniform from each row's own generator. (torch.multinomial
    # a row at a time cost ~20 times a whole-batch pass over the logits on CPU.)
    uniform = torch.stack([draw_uniform(generators[row], device) for row in sampled_rows])  # [S]
    cdf = probs.cumsum_(dim=-1)  # [S, V]
    total = cdf[:, -1]
    # Strictly below the total, so the first cdf entry above it exists; that entry is
    # where the cdf rose, so its token has a probability > 0.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    drawn.clamp_(max=vocab - 1)  # only NaN logits could reach vocab
    if every_row:
        return drawn
    return token_ids.index_copy_(0, rows, drawn)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first one on ties, as torch.argmax), int64."""
    if logits.device.type == "cpu":
        # numpy's argmax, vectorized for the CPU it runs on: over a batch of rows it measured
        # faster than torch's, and than the C kernel of cpu_kernels/argmax.py on an AVX2 CPU
        # in float32 and in bfloat16, the float32 copy counted (bench/kernels/argmax_paths.py
        # compares the three; the kernel stays, tested, but nothing serves it until it is
        # measured faster than this somewhere).
        rows = logits.float().contiguous().numpy()  # numpy has no bfloat16
        return torch.from_numpy(rows.argmax(axis=-1).astype("int64", copy=False))
    return logits.argmax(dim=-1)


# The nucleus almost always lies within the best few hundred tokens; looking there first
# avoids sorting the whole vocabulary (a sort costs ~6 passes over it, topk(1024) ~2).
NUCLEUS_CANDIDATES = 1024


def _nucleus_in_full(device: torch.device) -> bool:
    """Whether every row is sorted in full to find its nucleus, rather than its best
    NUCLEUS_CANDIDATES first. Off the CPU: which rows' nuclei outrun the candidates is
    known only on the device, and asking would make the host wait for it (a second sync
    a step); a [B, V] sort is one kernel there (vLLM's apply_top_k_top_p sorts in full
    too). On the CPU the answer costs nothing and the sort ~3 times topk(1024)."""
    return device.type != "cpu"


def _nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor, support: int) -> torch.Tensor:
    """probs [P, V], top_p [P, 1] → [P, 1]: the smallest probability in each nucleus.

    `support` bounds how many tokens of a row may have a probability above 0 (the top-k).

    The nucleus is the best tokens, in order, up to and including the first at which
    the mass of those ranked above it reaches top_p; the best token is always in it.
    """
    if _nucleus_in_full(probs.device):
        return _threshold_in_sorted(torch.sort(probs, dim=-1, descending=True).values, top_p)[0]
    candidates = min(NUCLEUS_CANDIDATES, support, probs.shape[1])
    best = torch.topk(probs, candidates, dim=-1).values  # [P, C], descending
    threshold, kept = _threshold_in_sorted(best, top_p)
    if candidates < probs.shape[1]:
        # A nucleus that takes every candidate may reach past them (a flat distribution):
        # those rows sort in full.
        for index in (kept.squeeze(1) == candidates).nonzero().squeeze(1).tolist():
            if int((probs[index] > 0).sum()) <= candidates:
                continue  # the nucleus is every token left (top-k, or ties at its edge)
            row = torch.sort(probs[index], descending=True).values.unsqueeze(0)
            threshold[index] = _threshold_in_sorted(row, top_p[index : index + 1])[0][0]
    return threshold


def _threshold_in_sorted(
    sorted_probs: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_probs [P, C] descending, top_p [P, 1] → (threshold [P, 1], nucleus size [P, 1])."""
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = (mass_above < top_p).sum(dim=-1, keepdim=True)  # >= 1: the best has 0 above
    return sorted_probs.gather(1, kept - 1), kept
