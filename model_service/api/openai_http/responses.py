"""GenerateResponses -> OpenAI response objects, whole (stream: false) or as chunks.

One `Endpoint` per API (chat, completions) knows its object names and choice shapes; both
share the bookkeeping of usage and finish reasons. A choice's index is
`prompt_index * n + GenerateResponse.index`: a completions body with several prompts runs
one GenerateRequest per prompt, each with n completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from model_service.api.openai_http.logprobs import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from pagedkv.model.v1 import model_pb2

FINISH_REASON = {
    model_pb2.FINISH_REASON_LENGTH: "length",
    model_pb2.FINISH_REASON_STOP: "stop",
    model_pb2.FINISH_REASON_EOS: "stop",
    model_pb2.FINISH_REASON_ABORT: "abort",  # vLLM's name; OpenAI has none
}


def stop_reason(response: model_pb2.GenerateResponse) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the choice."""
    which = response.WhichOneof("matched_stop")
    return None if which is None else getattr(response, which)


@dataclass(slots=True)
class Usage:
    """Token counts of one body: each prompt counted once, whatever its n.

    pagedkv's own `peak_kv_blocks`, `peak_kv_bytes`, `recomputed_tokens` and the
    speculative `spec_proposed_tokens` and `spec_accepted_tokens` (at the top
    level of `usage`, where the openai package keeps fields it does not know) are summed
    over the choices, as completion_tokens is: a body has one usage, and gRPC's are per
    completion. A prompt block the n completions of one prompt share counts in each, so
    the sum can exceed the blocks the body held at once."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> tokens
    cached_tokens: dict[int, int] = field(default_factory=dict)
    # Of cached_tokens, per prompt: promoted from the cache service's host, disk and remote tiers.
    cached_tiers: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    completion_tokens: int = 0
    peak_kv_blocks: int = 0
    peak_kv_bytes: int = 0
    recomputed_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0

    def add(self, prompt_index: int, response: model_pb2.GenerateResponse) -> None:
        usage = response.usage
        self.prompt_tokens[prompt_index] = max(self.prompt_tokens.get(prompt_index, 0), usage.prompt_tokens)
        if usage.cached_tokens >= self.cached_tokens.get(prompt_index, 0):
            self.cached_tiers[prompt_index] = (usage.cached_tokens_host, usage.cached_tokens_disk,
                                               usage.cached_tokens_remote)
        self.cached_tokens[prompt_index] = max(self.cached_tokens.get(prompt_index, 0), usage.cached_tokens)
        self.completion_tokens += usage.completion_tokens
        self.peak_kv_blocks += usage.peak_kv_blocks
        self.peak_kv_bytes += usage.peak_kv_bytes
        self.recomputed_tokens += usage.recomputed_tokens
        self.spec_proposed_tokens += usage.spec_proposed_tokens
        self.spec_accepted_tokens += usage.spec_accepted_tokens

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": sum(self.cached_tokens.values()),
                "cached_tokens_host": sum(tiers[0] for tiers in self.cached_tiers.values()),
                "cached_tokens_disk": sum(tiers[1] for tiers in self.cached_tiers.values()),
                "cached_tokens_remote": sum(tiers[2] for tiers in self.cached_tiers.values()),
            },
            "peak_kv_blocks": self.peak_kv_blocks,
            "peak_kv_bytes": self.peak_kv_bytes,
            "recomputed_tokens": self.recomputed_tokens,
            "spec_proposed_tokens": self.spec_proposed_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }


@dataclass(slots=True)
class Choice:
    """One choice accumulated over its stream, for a stream: false answer."""

    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    length: int = 0  # characters of text so far
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Endpoint:
    """What chat and completions share; subclasses name their objects and choice shapes."""

    object_name: str
    chunk_object_name: str

    def __init__(self, response_id: str, model: str, n: int, names: TokenNames, logprobs: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.n = n
        self.names = names
        self.logprobs = logprobs
        self.created = int(time.time())
        self.usage = Usage()
        self.choices: dict[int, Choice] = {}

    def choice_index(self, prompt_index: int, response: model_pb2.GenerateResponse) -> int:
        return prompt_index * self.n + response.index

    # -- stream: false --------------------------------------------------------------------

    def add(self, prompt_index: int, response: model_pb2.GenerateResponse) -> None:
        choice = self.choices.setdefault(self.choice_index(prompt_index, response), Choice())
        if self.logprobs and response.logprobs:
            choice.logprobs.append(self._logprobs(response, choice.length))
        choice.text.append(response.text)
        choice.length += len(response.text)
        if response.finish_reason:
            choice.finish_reason = FINISH_REASON.get(response.finish_reason, "stop")
            choice.stop_reason = stop_reason(response)
            self.usage.add(prompt_index, response)

    def body(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice_body(index, self.choices[index]) for index in sorted(self.choices)],
            "usage": self.usage.body(),
        }

    # -- stream: true ---------------------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = False) -> dict[str, Any]:
        chunk = {"id": self.response_id, "object": self.chunk_object_name, "created": self.created,
                 "model": self.model, "choices": choices}
        if with_usage_field or usage is not None:
            chunk["usage"] = usage
        return chunk

    def first_chunks(self, num_choices: int) -> list[list[dict[str, Any]]]:
        """Choices of the chunks sent before any token (chat: the role of each choice)."""
        return []

    def stream_choices(self, prompt_index: int, response: model_pb2.GenerateResponse) -> list[list[dict[str, Any]]]:
        """Choices of the chunks that carry this response (one chunk each)."""
        raise NotImplementedError

    def _logprobs(self, response: model_pb2.GenerateResponse, text_offset: int):
        raise NotImplementedError

    def _choice_body(self, index: int, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError


class ChatEndpoint(Endpoint):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _logprobs(self, response, text_offset):
        return chat_logprobs(response.logprobs, self.names)

    def _choice_body(self, index: int, choice: Choice) -> dict[str, Any]:
        content = [entry for part in choice.logprobs for entry in part]
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": {"content": content} if self.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def first_chunks(self, num_choices: int) -> list[list[dict[str, Any]]]:
        return [[{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}] for index in range(num_choices)]

    def stream_choices(self, prompt_index, response):
        index = self.choice_index(prompt_index, response)
        chunks = []
        if response.text or response.logprobs:
            logprobs = {"content": self._logprobs(response, 0)} if self.logprobs else None
            chunks.append([{"index": index, "delta": {"content": response.text}, "logprobs": logprobs,
                            "finish_reason": None}])
        if response.finish_reason:
            self.usage.add(prompt_index, response)
            # OpenAI ends each choice with an empty delta that carries the reason.
            chunks.append([{"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": FINISH_REASON.get(response.finish_reason, "stop"),
                            "stop_reason": stop_reason(response)}])
        return chunks


class CompletionEndpoint(Endpoint):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._streamed_length: dict[int, int] = {}  # choice index -> characters sent

    def _logprobs(self, response, text_offset):
        return completion_logprobs(response.logprobs, self.names, text_offset, len(response.text))

    def _choice_body(self, index: int, choice: Choice) -> dict[str, Any]:
        return {
            "index": index,
            "text": "".join(choice.text),
            "logprobs": merge_completion_logprobs(choice.logprobs) if self.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def stream_choices(self, prompt_index, response):
        index = self.choice_index(prompt_index, response)
        offset = self._streamed_length.get(index, 0)
        self._streamed_length[index] = offset + len(response.text)
        choice = {"index": index, "text": response.text,
                  "logprobs": self._logprobs(response, offset) if self.logprobs else None,
                  "finish_reason": None, "stop_reason": None}
        if response.finish_reason:
            self.usage.add(prompt_index, response)
            choice["finish_reason"] = FINISH_REASON.get(response.finish_reason, "stop")
            choice["stop_reason"] = stop_reason(response)
        elif not response.text and not response.logprobs:
            return []
        return [[choice]]
