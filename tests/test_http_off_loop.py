"""The HTTP door tokenizes prompts where gRPC does, on worker threads, never on the event
loop that every stream of both doors shares: plain code over a recording engine stand-in
(what it records is which thread encoded each prompt, and which requests were cancelled).
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from model_service.api.generation import GenerateError, GenerationService
from model_service.api.openai_http.streaming import Running
from model_service.engine.settings import EngineSettings
from pagedkv.model.v1 import model_pb2


class RecordingTokenizer:
    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1 + ord(character) % 50 for character in text]


class RecordingEngine:
    """What GenerationService asks of an engine, with every submit and cancel kept."""

    def __init__(self) -> None:
        self.loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=64), tokenizer=RecordingTokenizer(),
                                      chat_template=None)
        self.settings = EngineSettings(max_model_len=256)
        self.eos_token_ids = frozenset({0})
        self.max_total_tokens = 0
        self.submitted: list[str] = []
        self.cancelled: list[int] = []
        self.how: dict[str, dict] = {}  # request id -> submit's keyword arguments (priority, cache_salt, ...)

    def submit(self, request_id, prompt_token_ids, options, sink, **how) -> int:
        self.submitted.append(request_id)
        self.how[request_id] = how
        return len(self.submitted)

    def cancel(self, key: int) -> None:
        self.cancelled.append(key)


def service() -> GenerationService:
    return GenerationService(RecordingEngine(), default_max_new_tokens=4, max_prompt_tokens=200)


def test_a_list_of_prompts_is_tokenized_off_the_event_loop():
    generation = service()
    requests = [model_pb2.GenerateRequest(request_id=f"r-{index}", prompt=f"prompt {index}") for index in range(3)]

    async def start() -> tuple[Running, int]:
        return await Running.start(generation, requests), threading.get_ident()

    running, loop_thread = asyncio.run(start())
    tokenizer = generation.engine.loaded.tokenizer
    assert len(tokenizer.threads) == 3 and loop_thread not in tokenizer.threads
    assert sorted(generation.engine.submitted) == ["r-0", "r-1", "r-2"]
    running.close()
    assert sorted(generation.engine.cancelled) == [1, 2, 3]


def test_one_refused_prompt_closes_those_started():
    generation = service()
    requests = [model_pb2.GenerateRequest(request_id="fine", prompt="fine"),
                model_pb2.GenerateRequest(request_id="too-long", prompt="x" * 300)]
    with pytest.raises(GenerateError) as error:
        asyncio.run(Running.start(generation, requests))
    assert "300 tokens" in error.value.message
    assert generation.engine.cancelled == [1] and generation.open_streams == 0
