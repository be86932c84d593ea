"""Sampling: per-request options (no wire types), the logits pipeline, the batched sampler and logprobs."""
