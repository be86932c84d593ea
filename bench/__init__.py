"""Benchmarks by subject: serve/ (end to end, against vLLM and llama.cpp), engine/ (the engine
and its steps in process), kernels/ (the C and Triton kernels alone), cache/ (the block pool,
leases, tiers). Run from the repository root, e.g. `.venv/bin/python -m bench.serve.bench_vs_vllm --help`."""
