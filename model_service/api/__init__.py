"""The front doors: gRPC (servicer.py) and the OpenAI HTTP API (openai_http/), over one validation and one Generate path (generation.py)."""
