"""Scheduling in pure Python, no tensors and no gRPC: sequences, continuous batching, and the lease operations a step needs."""
