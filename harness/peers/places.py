"""Where the peers live: their worker scripts here (run by path, each in its peer's own venv,
so they import nothing of this project), their venvs and the benchmarks' made files under
bench/ (bench/.venv-vllm, bench/.venv-llamacpp, bench/.cache/, all in .gitignore)."""

from pathlib import Path

PEERS = Path(__file__).resolve().parent
BENCH = PEERS.parents[1] / "bench"
CACHE_DIR = BENCH / ".cache"
