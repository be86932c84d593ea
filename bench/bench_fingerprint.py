"""Start-up cost of the model fingerprint for a multi-GB checkpoint.

    python bench/bench_fingerprint.py --gib 2 --directory /tmp/fp-bench

Writes a Hugging Face style directory (config.json, tokenizer.json and one safetensors
file of about --gib GiB of random float16 weights), fingerprints it three times (the
first read may come from disk; the others from the page cache) and deletes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from model_service.loading.fingerprint import checkpoint_fingerprint


def write_checkpoint(directory: Path, gib: float) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}))
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}}}))
    tensors, remaining, index = {}, int(gib * 2**30), 0
    generator = torch.Generator().manual_seed(0)
    while remaining > 0:
        rows = min(remaining // (4096 * 2), 16384)
        tensors[f"model.layers.{index}.weight"] = torch.randn(rows, 4096, generator=generator).half()
        remaining -= rows * 4096 * 2
        index += 1
    save_file(tensors, str(directory / "model.safetensors"))
    return sum(path.stat().st_size for path in directory.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--directory", default="/tmp/pagedkv-fingerprint-bench")
    args = parser.parse_args()
    directory = Path(args.directory) / "checkpoint"
    try:
        size = write_checkpoint(directory, args.gib)
        os.sync()
        for run in range(3):
            started = time.perf_counter()
            fingerprint = checkpoint_fingerprint(directory)
            seconds = time.perf_counter() - started
            print(f"run {run}: {size / 2**30:.2f} GiB in {seconds:.3f} s = {size / 2**30 / seconds:.1f} GiB/s  {fingerprint}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
