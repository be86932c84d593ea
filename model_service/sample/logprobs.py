"""Logprobs of chosen tokens and their top alternatives, from the model's raw logits.

Raw means before penalties, logit_bias, temperature, min_p, top-k and top-p (vLLM's
default `raw_logprobs`): the log-softmax of what the model said, in float32. One pass
for all rows that asked, whatever their top counts; each row keeps its own count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_service.device_copies import to_host


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens, (token_id, logprob), by logprob descending.
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, tops: Sequence[int]) -> list[TokenLogprob]:
    """logits [R, V], token_ids [R] (the token chosen at each row), tops[r] alternatives
    for row r → one TokenLogprob a row; one wait for the device."""
    host_token_ids, *found = to_host(token_ids, *logprob_tensors(logits, token_ids, tops))
    return read_logprobs(host_token_ids.tolist(), found, tops)


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, tops: Sequence[int]) -> list[torch.Tensor]:
    """On the device, nothing read back: [chosen [R]], or [chosen [R], values [R, K],
    ids [R, K]] when some row asks for K = max(tops) alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device)).squeeze(1)
    most = max(tops, default=0)
    if not most:
        return [chosen]
    # topk sorts descending; among equal logprobs it may order ids either way.
    values, ids = torch.topk(logprobs, most, dim=-1)
    return [chosen, values, ids]


def read_logprobs(token_ids: list[int], found: Sequence[torch.Tensor], tops: Sequence[int]) -> list[TokenLogprob]:
    """One TokenLogprob a row from logprob_tensors' tensors, once they are on the host."""
    chosen = found[0].tolist()
    values, ids = (found[1].tolist(), found[2].tolist()) if len(found) == 3 else ([], [])
    out = []
    for row, top in enumerate(tops):
        alternatives = tuple(zip(ids[row][:top], values[row][:top])) if top else ()
        out.append(TokenLogprob(token_ids[row], chosen[row], alternatives))
    return out
