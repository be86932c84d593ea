"""The peers pagedkv is measured against, each in a venv of its own: vLLM (vllm_offline.py, vllm_grpc.py,
vllm_cores.py) and llama.cpp (llamacpp.py). The *_worker.py and vllm_cli.py scripts run in those
venvs, by path, and import nothing of this project."""
