"""OpenAI fields with a real meaning that this server does not implement.

A request that uses one gets a 400 naming it, never an answer that silently ignores it;
the values clients send to mean "off" (functions=[], function_call="none", ...) pass.
Tools and response_format are implemented (tools.py, structured.py), and so are tool
calls and tool results in the messages (to_generate.py).
"""

from __future__ import annotations

from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields


def refuse_unsupported(body: GenerationFields) -> None:
    if body.return_hidden_states:
        raise not_supported("return_hidden_states", "hidden states are not returned")
    if body.include_reasoning is False:
        raise not_supported("include_reasoning", "reasoning is not parsed out of the content, so it cannot be "
                            "left out")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise not_supported("stream_options.continuous_usage_stats", "usage comes in the last chunk "
                            "(stream_options.include_usage)")
    if isinstance(body, ChatCompletionRequest):
        _refuse_chat(body)
    elif isinstance(body, CompletionRequest):
        _refuse_completion(body)


def _refuse_chat(body: ChatCompletionRequest) -> None:
    if body.functions:
        raise not_supported("functions", "the legacy functions field is not implemented; send tools")
    if body.function_call not in (None, "none", "auto"):
        raise not_supported("function_call", "the legacy function_call field is not implemented; send tool_choice")
    if body.modalities not in (None, ["text"]) or body.audio:
        raise not_supported("modalities" if body.modalities not in (None, ["text"]) else "audio",
                            "only text output is implemented")
    if body.prediction:
        raise not_supported("prediction", "predicted outputs are not implemented")
    if body.web_search_options is not None:
        raise not_supported("web_search_options", "web search is not implemented")
    if body.reasoning_effort is not None or body.verbosity is not None:
        name = "reasoning_effort" if body.reasoning_effort is not None else "verbosity"
        raise not_supported(name, "pass the checkpoint's own switch in chat_template_kwargs instead "
                            "(e.g. {'enable_thinking': false})")
    if not body.add_generation_prompt or body.continue_final_message:
        name = "add_generation_prompt" if not body.add_generation_prompt else "continue_final_message"
        raise not_supported(name, "messages are always rendered with the generation prompt appended")
    for index, message in enumerate(body.messages):
        if message.function_call:
            raise not_supported(f"messages[{index}].function_call", "the legacy function_call of a message is not "
                                "implemented; send the call in tool_calls")


def _refuse_completion(body: CompletionRequest) -> None:
    if body.echo:
        raise not_supported("echo", "the prompt is not echoed back")
    if body.suffix:
        raise not_supported("suffix", "insertion (suffix) is not implemented")
    if body.best_of is not None and body.best_of != body.n:
        raise not_supported("best_of", "best_of other than n is not implemented; ask for n completions")


def not_supported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param} is not supported by this server: {why}", param=param,
                    code="unsupported_parameter")
