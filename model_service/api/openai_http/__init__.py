"""The OpenAI-compatible HTTP front door of the model service.

`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`, served by uvicorn
in the model service's own event loop. A request body is parsed (protocol), translated
into a `GenerateRequest` (to_generate) and run through the same GenerationService as a
gRPC Generate call, so validation, limits and every sampling feature are the gRPC path's;
the results are translated back into OpenAI objects (responses, streaming) and errors
into OpenAI error objects (errors).
"""
