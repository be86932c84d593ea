"""One gRPC Generate call read to its end, and what the tests read off it."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.model.v1 import model_pb2

GREEDY = dict(temperature=0, ignore_eos=True)


@dataclass
class Generated:
    """Every message of one Generate call (n = 1), in order."""

    responses: list[model_pb2.GenerateResponse]

    @property
    def tokens(self) -> list[int]:
        return [token for response in self.responses for token in response.token_ids]

    @property
    def text(self) -> str:
        return "".join(response.text for response in self.responses)

    @property
    def last(self) -> model_pb2.GenerateResponse:
        return self.responses[-1]

    @property
    def usage(self) -> model_pb2.Usage:
        return self.responses[-1].usage


def generate(stub, *, sampling: dict, timeout: float = 120, metadata=None, **fields) -> Generated:
    """GenerateRequest(**fields) with SamplingParams(**sampling), read to its end."""
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling), **fields)
    return Generated(list(stub.Generate(request, timeout=timeout, metadata=metadata)))


def greedy(stub, prompt_token_ids, max_new_tokens: int, timeout: float = 120,
           **fields) -> tuple[list[int], model_pb2.GenerateResponse]:
    """Greedy, eos ignored (exactly max_new_tokens tokens): its tokens and its last message.
    fields: the rest of GenerateRequest (a text `prompt` with prompt_token_ids empty)."""
    answer = generate(stub, prompt_token_ids=prompt_token_ids, timeout=timeout,
                      sampling=dict(GREEDY, max_new_tokens=max_new_tokens), **fields)
    return answer.tokens, answer.last
