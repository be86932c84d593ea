"""Regenerates the flag and metric tables in docs/ from the code (run: python scripts/readme_tables.py).

The flag tables come from the argparse parsers of `python -m cache_service`,
`python -m model_service` and `python -m pagedkv.stack` and live in docs/configuration.md;
the metric tables come from the Prometheus objects of cache_service/api/metrics.py,
cache_service/events/replay.py and model_service/metrics.py and live in docs/operations.md.
Each table sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers in the file
MARKERS names and is replaced whole; so is the output of the sizing calculator for the
Llama-3-8B config.json of docs/sizing.md (between `<!-- sizing-example:... -->`).
tests/test_readme.py fails when a file differs from what this script writes, so a new flag
or metric cannot go undocumented.

    python scripts/readme_tables.py          # rewrite the docs in place
    python scripts/readme_tables.py --check  # exit 1 if any of them is out of date
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = "docs/configuration.md"
OPERATIONS = "docs/operations.md"
SIZING = "docs/sizing.md"
# Marker name -> the file, relative to ROOT, that holds the generated text.
MARKERS = {
    "flags-cache": CONFIGURATION,
    "flags-model": CONFIGURATION,
    "flags-stack": CONFIGURATION,
    "metrics-cache": OPERATIONS,
    "metrics-model": OPERATIONS,
    "sizing-example": SIZING,
}



def _parsers() -> dict[str, argparse.ArgumentParser]:
    # The parsers read PAGEDKV_* twins for their defaults; a developer's shell must not
    # leak into the documented defaults.
    for name in [name for name in os.environ if name.startswith("PAGEDKV_")]:
        del os.environ[name]
    from cache_service.api.server import build_parser as cache_parser
    from model_service.server import build_parser as model_parser
    from pagedkv.stack import build_parser as stack_parser

    return {"cache": cache_parser(), "model": model_parser(), "stack": stack_parser()}


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The --flags of a parser, in the order they were added (not --help)."""
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch (store_true)
        return "on" if action.default else "off"
    if action.default is None:
        return "(none)"
    return f"`{action.default}`"


def _meaning(action: argparse.Action) -> str:
    """The help text without what add_flag appended: " (default: X)" and " [env PAGEDKV_Y]"."""
    from pagedkv.flags import env_name

    meaning = (action.help or "").removesuffix(f" [env {env_name(action.option_strings[-1])}]")
    if action.default is not None and action.default is not False:
        meaning = meaning.removesuffix(f" (default: {action.default})")
    if action.choices:
        meaning += f" (one of: {', '.join(map(str, action.choices))})"
    return meaning


def flag_table(parser: argparse.ArgumentParser) -> str:
    from pagedkv.flags import env_name

    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for action in flag_actions(parser):
        flag = action.option_strings[-1]
        rows.append(f"| `{flag}` | `{env_name(flag)}` | {_cell(_default(action))} | {_cell(_meaning(action))} |")
    return "\n".join(rows)


def _exposed(name: str, kind: str) -> str:
    """The series name Prometheus text shows: counters get _total; histograms show the base
    name here and add _bucket, _sum and _count."""
    return f"{name}_total" if kind == "counter" else name


def _metric_rows(families) -> list[str]:
    rows = []
    for family, labels in families:
        label_text = ", ".join(f"`{label}`" for label in labels) or ""
        rows.append(f"| `{_exposed(family.name, family.type)}` | {family.type} | {label_text} | "
                    f"{_cell(family.documentation)} |")
    return rows


def _module_families(module) -> list:
    from prometheus_client.metrics import MetricWrapperBase

    families = []
    for value in vars(module).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                families.append((family, list(value._labelnames)))
    return families


class _FakeLedger:
    def stats(self):
        return SimpleNamespace(blocks_total=1, blocks_free=1, blocks_leased=0, blocks_cached=0,
                               sequences=0, prefix_queries=0, prefix_hits=0)


def _tiers():
    """A one-block host tier and a remote tier (never asked anything), so the collector yields the tier series too."""
    import torch

    from cache_service.blocks.block_pool import BlockPool
    from cache_service.tiers.disk_tier import DiskGeometry
    from cache_service.tiers.kv_tiers import KvTiers
    from cache_service.tiers.settings import TierSettings

    geometry = DiskGeometry(1, 1, 1, 1, torch.float32)
    settings = TierSettings(host_cache_bytes=geometry.payload_bytes, remote_kv="valkey://127.0.0.1:6379",
                            remote_kv_key_file="unread")
    return KvTiers(BlockPool(1, 1), torch.zeros(1, 2, 1, 1, 1, 1), settings, geometry.payload_bytes, geometry,
                   remote_key=bytes(32))


def _pool_collector_families() -> list:
    from cache_service.api.metrics import PoolCollector

    pool = SimpleNamespace(sessions={}, ledger=_FakeLedger(), sizing=SimpleNamespace(pool_bytes=0), tiers=_tiers())
    families = []
    for family in PoolCollector(pool).collect():
        labels = sorted({key for sample in family.samples for key in sample.labels})
        families.append((family, labels))
    return families


def metric_table(families) -> str:
    header = ["| series | type | labels | meaning |", "| --- | --- | --- | --- |"]
    return "\n".join(header + _metric_rows(families))


def tables() -> dict[str, str]:
    """Marker name -> table text."""
    from cache_service.api import metrics as cache_metrics
    from cache_service.events import replay as event_replay
    from model_service import metrics as model_metrics

    parsers = _parsers()
    return {
        "flags-cache": flag_table(parsers["cache"]),
        "flags-model": flag_table(parsers["model"]),
        "flags-stack": flag_table(parsers["stack"]),
        "metrics-cache": metric_table(_pool_collector_families() + _module_families(cache_metrics)
                                      + _module_families(event_replay)),
        "metrics-model": metric_table(_module_families(model_metrics)),
    }


SIZING_COMMAND = "python -m cache_service sizing --config /tmp/llama3-8b/config.json --memory 80GiB --dtype bfloat16"


def sizing_example(document: str) -> str:
    """The calculator's output for docs/sizing.md's Llama-3-8B config.json, under the command shown."""
    import contextlib
    import io
    import tempfile

    from cache_service.api.sizing_cli import main as sizing_main

    match = re.search(r"<!-- llama3-config:begin -->\n```json\n(.*?)\n```\n<!-- llama3-config:end -->", document, re.S)
    if not match:
        raise SystemExit(f"{SIZING} has no <!-- llama3-config:begin --> block with a config.json")
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "config.json"
        config.write_text(match.group(1))
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            argv = SIZING_COMMAND.split()[4:]
            code = sizing_main([str(config) if part.endswith("config.json") else part for part in argv])
    if code != 0:
        raise SystemExit(f"the sizing calculator failed ({code}) on {SIZING}'s config.json")
    return f"```\n$ {SIZING_COMMAND}\n{output.getvalue().rstrip()}\n```"


def render(document: str, generated: dict[str, str], name: str = "the document") -> str:
    """document with the text between each marker of generated replaced by its value."""
    for marker, table in generated.items():
        pattern = re.compile(rf"(<!-- {marker}:begin -->\n)(?:.*?\n)?(<!-- {marker}:end -->)", re.S)
        if not pattern.search(document):
            raise SystemExit(f"{name} has no <!-- {marker}:begin --> ... <!-- {marker}:end --> markers")
        document = pattern.sub(lambda match: match.group(1) + table + "\n" + match.group(2), document)
    return document


def documents() -> dict[str, tuple[str, str]]:
    """Each file MARKERS names -> (its text now, its text with every generated part current)."""
    generated = tables()
    result = {}
    for path in sorted(set(MARKERS.values())):
        current = (ROOT / path).read_text()
        mine = {marker: text for marker, text in generated.items() if MARKERS[marker] == path}
        if MARKERS["sizing-example"] == path:
            mine["sizing-example"] = sizing_example(current)
        result[path] = (current, render(current, mine, path))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date, write nothing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    texts = documents()
    stale = [path for path, (current, wanted) in texts.items() if wanted != current]
    if args.check:
        if stale:
            print(f"{', '.join(stale)}: flag or metric tables or the sizing example out of date: "
                  "run python scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    for path in stale:
        (ROOT / path).write_text(texts[path][1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
