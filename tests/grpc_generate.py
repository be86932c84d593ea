"""One gRPC Generate call read to its end, and what the tests read off it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

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


def deadline_after_first_token(stub, request: model_pb2.GenerateRequest, settled: Callable[[], None],
                               give_up_s: float = 120) -> int:
    """Calls Generate with deadlines that double from 10 ms until one passes after a first
    token came back; every try must end DEADLINE_EXCEEDED, and ``settled`` (which waits
    until the try's blocks are released) runs after each. Returns the last try's tokens.

    No speed is assumed: the try that first gets a token has a deadline at most about twice
    its time to the first token, far too short for a request of hundreds of steps to end.
    """
    timeout_s = 0.01
    while True:
        tokens = 0
        try:
            for response in stub.Generate(request, timeout=timeout_s):
                tokens += len(response.token_ids)
            raise AssertionError(f"the request finished within a {timeout_s} s deadline after {tokens} tokens")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (timeout_s, error.code(), error.details())
        settled()
        if tokens:
            return tokens
        timeout_s *= 2
        assert timeout_s <= give_up_s, f"no token came back within {timeout_s / 2} s"
