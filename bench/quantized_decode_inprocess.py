"""Decode steps of SmolLM2's Q4_1 GGUF in process, --weights native against dequantize in
turns: one sequence, 16 greedy steps a round, 3 rounds, tokens/s (no services, no gRPC;
tests/paged_runner.py does the bookkeeping). A quick check where bench_quantized.py's two
service pairs are too slow to start on a loaded machine.

    PYTHONPATH=. .venv/bin/python bench/quantized_decode_inprocess.py THREADS
"""

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from paged_runner import PagedRunner  # noqa: E402

from model_service.loading.loader import load_model  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.testing.assert_close = lambda *args, **kwargs: None  # PagedRunner's own self-check, not timed here
models = {mode: load_model("smollm2", torch.float32, "cpu", weights=mode) for mode in ("native", "dequantize")}
rates: dict[str, list[float]] = {mode: [] for mode in models}
for _ in range(3):
    for mode, loaded in models.items():
        runner = PagedRunner(loaded.model, loaded.config)
        (logits,) = runner.step([("a", [1, 2, 3, 4])], 0)
        token = int(logits[-1].argmax())
        started = time.perf_counter()
        for _ in range(16):
            (logits,) = runner.step([("a", [token])], 1)
            token = int(logits[-1].argmax())
        rates[mode].append(16 / (time.perf_counter() - started))
for mode, values in rates.items():
    print(mode, "median tok/s", round(statistics.median(values), 1), [round(value, 1) for value in values])
