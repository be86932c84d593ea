"""The networks: Llama-family decoders over the paged KV pool, their config, RoPE and fused ops.

Where a model comes from (checkpoints, GGUF files, the tiny model) is model_service.loading.
"""
