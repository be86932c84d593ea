"""A checkpoint's identity by content: what Attach sends as model_fingerprint.

The cache service seeds each session's prefix-hash chain with it, so two models of the
same KV geometry share the pool but never a cached prefix (other weights give other
K/V for the same tokens), while the same checkpoint restarted, or moved to another
path, keeps hitting its cache.

The hash covers every byte that decides the model's K/V or its token ids: the config,
the tokenizer files and the weights. It is xxh3_128 (xxhash) over the mapped files:
not a cryptographic hash (whoever can attach to the cache service is trusted with every
model's K/V anyway, see docs/tenants-and-security.md, "Credentials"), but two checkpoints
that differ in any byte get different fingerprints, and hashing a checkpoint already in
the page cache costs little beside loading it (docs/benchmark-log.md, "Model fingerprint"). Nothing is cached on disk.

- a Hugging Face directory: the config, tokenizer and weight files in it (names, sizes,
  content), in name order;
- a single file (a .gguf, or an embedded model's, `--model smollm2`): its content,
  whatever its name;
- `tiny`: its construction recipe: seed, config and the source that builds it.
"""

from __future__ import annotations

import inspect
import mmap
import os
from pathlib import Path

import xxhash

from model_service.loading import tiny
from model_service.errors import ModelLoadError

SCHEME = "xxh3_128"
# What a Hugging Face directory holds that decides K/V or token ids: configs (config.json,
# tokenizer_config.json, the safetensors index...), weights, and tokenizer data in its
# other formats (sentencepiece .model, merges/vocab .txt, chat templates). Other files
# (README.md, a second copy of the weights as .bin) are not read: they change nothing
# served, and hashing them would cost start-up time.
HF_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")


def checkpoint_fingerprint(spec: str | Path) -> str:
    """The fingerprint of `tiny`, a checkpoint directory or a checkpoint file."""
    if str(spec) == "tiny":
        return tiny_fingerprint()
    path = Path(spec).expanduser()
    if path.is_dir():
        return directory_fingerprint(path)
    if path.is_file():
        return file_fingerprint(path)
    embedded = _embedded_model_path(str(spec))
    if embedded is not None:
        return file_fingerprint(embedded)
    raise ModelLoadError(f"cannot fingerprint model {str(spec)!r}: neither 'tiny' nor an existing file or directory")


def _embedded_model_path(spec: str) -> Path | None:
    """The file of a model shipped in a package (`--model smollm2`), where that exists."""
    try:
        from model_service.loading import embedded
    except ImportError:  # no embedded models in this build
        return None
    if spec not in getattr(embedded, "EMBEDDED_MODELS", ()):
        return None
    return embedded.embedded_model_path(spec)


def tiny_fingerprint() -> str:
    digest = xxhash.xxh3_128()
    digest.update(f"tiny seed={tiny.TINY_SEED} config={tiny.tiny_config()!r}\n".encode())
    # The recipe itself: a change to how the weights are drawn is another model.
    digest.update(inspect.getsource(tiny).encode())
    return f"{SCHEME}:{digest.hexdigest()}"


def directory_fingerprint(directory: Path) -> str:
    files = sorted(path for path in directory.iterdir() if path.is_file() and path.name.endswith(HF_SUFFIXES))
    if not files:
        raise ModelLoadError(f"cannot fingerprint {directory}: it holds no config, tokenizer or weight files")
    digest = xxhash.xxh3_128()
    for path in files:
        # Name and size first, so that bytes cannot move from one file to the next unseen.
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        _update_from_file(digest, path)
    return f"{SCHEME}:{digest.hexdigest()}"


def file_fingerprint(path: Path) -> str:
    digest = xxhash.xxh3_128()
    digest.update(f"{path.stat().st_size}\0".encode())
    _update_from_file(digest, path)
    return f"{SCHEME}:{digest.hexdigest()}"


def _update_from_file(digest: xxhash.xxh3_128, path: Path) -> None:
    # Hashed straight from a read-only mapping: no copy into a Python buffer, which
    # measured faster than reading the file in 16 MiB pieces (docs/benchmark-log.md).
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size == 0:
                return
            with mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) as mapping:
                digest.update(mapping)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {path} to fingerprint the checkpoint: {error}") from None
