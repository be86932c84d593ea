"""Llama-family models over the paged KV pool: config, weights, the tiny model, loading.

Import from the modules themselves (models.config, models.llama, models.loader): this
package imports nothing, so model_service.tokenizer (which needs models.config) and
models.tiny (which needs the tokenizer) can each be imported first.
"""
