"""What tests, benchmarks (bench/) and checks (checks/) share: the services as real processes
(processes.py), clients and fixtures they drive them with (cache_helpers.py, the checkpoints of
hf_checkpoints.py, the in-process paged_runner.py, ...) and the peers pagedkv is measured
against (peers/: vLLM and llama.cpp). It imports the product; the product never imports it
(tests/test_import_rules.py).
"""
