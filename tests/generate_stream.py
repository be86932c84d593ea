"""One greedy Generate stream read on a thread of its own (eos ignored): the tests that
kill, preempt or abort something while streams run start them with it and wait on its
events."""

from __future__ import annotations

import threading

import grpc

from pagedkv.model.v1 import model_pb2


class GenerateStream:
    """Records the tokens, the last message and the final status (OK once it finished normally)."""

    def __init__(self, stub, tokens: list[int], max_new_tokens: int, timeout_s: float = 120,
                 request_id: str = "") -> None:
        self.tokens: list[int] = []
        self.last: model_pb2.GenerateResponse | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.first_token = threading.Event()
        self.done = threading.Event()
        self.started = threading.Event()  # a first token, or the end
        request = model_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=tokens, sampling=model_pb2.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True))
        self.call = stub.Generate(request, timeout=timeout_s)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.tokens.extend(response.token_ids)
                self.last = response
                self.first_token.set()
                self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details()
        finally:
            self.done.set()
            self.started.set()
