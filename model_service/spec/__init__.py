"""Speculative decoding: proposers (no tensors) and the rules that accept their tokens."""
