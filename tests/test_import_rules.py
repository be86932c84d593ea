"""The architecture's import rules, read from the source: which room may import which.

A rule broken here is a room that now depends on one it must not (the scheduler on the
device, the block pool on a model, sampling on the wire), which a test of behaviour
would not notice until the next feature tangles them further.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, absolute, whatever the import's form."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def files(*places: str) -> list[Path]:
    """The Python files of each folder, or each file itself; a place that is neither fails."""
    found = []
    for place in places:
        path = ROOT / place
        assert path.exists(), f"{place} does not exist: update the rules"
        found.extend([path] if path.is_file() else path.rglob("*.py"))
    return sorted(found)


def offenders(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in files(*folders):
        bad = sorted(m for m in imports_of(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


PEER_SCRIPTS = ("harness/peers/vllm_worker.py", "harness/peers/vllm_cli.py", "harness/peers/llamacpp_worker.py")


RULES = [
    # (who, may not import, why)
    (("cache_service",), ("model_service",), "the two services meet only in proto/ and pagedkv/"),
    (("model_service",), ("cache_service",), "the two services meet only in proto/ and pagedkv/"),
    # cache_service's layers, bottom up: blocks/ and events/, tiers/, core/, api/.
    (("cache_service/blocks",), ("torch", "model_service", "pagedkv.pool_memory", "cache_service.events",
                                 "cache_service.tiers", "cache_service.core", "cache_service.api"),
     "the block pool knows no model, no memory, no events, no tier and no lease"),
    (("cache_service/events",), ("torch", "cache_service.blocks", "cache_service.tiers", "cache_service.core",
                                 "cache_service.api"),
     "the KV events know vLLM's hashes and ZMQ, nothing of the pool they report on"),
    (("cache_service/tiers",), ("cache_service.core", "cache_service.api"),
     "the tiers hold blocks for the pool and know nothing of leases, sessions or the wire"),
    (("cache_service/core",), ("cache_service.api",), "the KV pool knows nothing of its front doors"),
    (("cache_service/blocks", "cache_service/events", "cache_service/tiers", "cache_service/core"),
     ("grpc", "pagedkv.cache", "pagedkv.model"), "only cache_service/api/ speaks the wire (its protos, grpc)"),
    (("cache_service/api/servicer.py",), ("cache_service.core.ledger", "cache_service.core.lease_ops",
                                          "cache_service.blocks", "cache_service.events"),
     "the servicer validates and calls KvPool; the ops and their outcomes are mapped in wire.py"),
    (("model_service/sched",), ("torch", "grpc", "model_service.worker", "model_service.models",
                                "model_service.attention", "model_service.cpu_kernels", "model_service.engine",
                                "model_service.cache", "model_service.api", "pagedkv.model", "pagedkv.cache"),
     "the scheduler is pure Python: no tensors, no device, no wire, no loop"),
    (("model_service/spec/ngram.py", "model_service/spec/settings.py", "model_service/spec/speculator.py"),
     ("torch", "grpc", "model_service.worker", "model_service.engine", "model_service.api"),
     "the scheduler asks the proposers: they know token ids, not tensors"),
    (("model_service/worker", "model_service/attention", "model_service/cpu_kernels", "model_service/models"),
     ("model_service.engine", "model_service.api", "model_service.cache", "grpc"),
     "the device code knows nothing of the loop, the session or the front doors"),
    (("model_service/sample",), ("grpc", "pagedkv.model", "model_service.api", "model_service.engine",
                                 "model_service.sched", "fastapi"),
     "sampling knows no wire and no engine"),
    (("model_service/text",), ("model_service.loading", "model_service.models", "model_service.engine"),
     "text in and out is a leaf the loaders and the engine use"),
    (("model_service/loading",), ("model_service.engine", "model_service.api", "model_service.sched"),
     "where a model comes from knows nothing of serving it"),
    (("model_service/lora",), ("model_service.engine", "model_service.api", "model_service.sched", "grpc"),
     "an adapter's files and slots know nothing of the loop or the front doors"),
    (("model_service/engine", "model_service/sched", "model_service/cache", "model_service/sample"),
     ("model_service.api", "fastapi", "starlette"), "nothing below the front doors imports them"),
    # What drives the product from outside: harness/ (shared), bench/, checks/, tests/.
    (("pagedkv", "cache_service", "model_service"), ("harness", "bench", "checks", "tests"),
     "the product never imports what tests, benchmarks and checks drive it with"),
    (("harness",), ("bench", "checks", "tests"), "harness/ is what the others share, so it needs none of them"),
    (("bench", "checks"), ("tests",), "what a benchmark shares with the tests lives in harness/"),
    (PEER_SCRIPTS,
     ("pagedkv", "cache_service", "model_service", "harness", "bench", "checks"),
     "the peers' scripts run by path in the peers' own venvs, where nothing of this project is installed"),
]


@pytest.mark.parametrize("who, forbidden, why", RULES, ids=[f"{r[0][0]}-not-{r[1][0]}" for r in RULES])
def test_import_rule(who, forbidden, why):
    assert offenders(who, forbidden) == {}, why


def test_no_module_beside_a_peer_script_shadows_what_it_imports():
    """A script run by path has its own folder first on sys.path: a module there named like
    a package the script imports (vllm.py beside vllm_worker.py) is imported in its place."""
    for script in PEER_SCRIPTS:
        path = ROOT / script
        beside = {sibling.stem for sibling in path.parent.glob("*.py")}
        shadowed = {name.partition(".")[0] for name in imports_of(path)} & beside
        assert not shadowed, f"{script} imports {sorted(shadowed)}, which its own folder's modules would shadow"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` and the modules of ``package`` it imports (type-only imports too)."""
    paths = {module_name(path): path for path in files(package)}
    return {module: {target for name in imports_of(path) for target in (name, name.rpartition(".")[0])
                     if target in paths and target != module}
            for module, path in paths.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := walk(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := walk(module)):
            return found
    return None


def test_cache_service_has_no_import_circle():
    assert cycle(import_graph("cache_service")) is None


def test_a_circle_is_seen():
    """The circle finder itself: a imports b imports c imports a is found, a tree is not."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_each_rule_reads_files():
    assert all(files(*who) for who, _, _ in RULES)


def test_the_rules_see_imports():
    """The checker itself: a file that imports the scheduler and torch is seen doing so."""
    assert {"torch", "model_service.sched.scheduler", "model_service.sched.scheduler.Scheduler"} <= imports_of(
        ROOT / "model_service" / "engine" / "loop.py")


def test_no_script_edits_sys_path():
    """bench/ and checks/ import the product and harness/ as packages (run with -m from the root,
    or by path once installed): a sys.path edit would hide a module that is not where it is named."""
    edits = [f"{path.relative_to(ROOT)}:{number}" for path in files("bench", "checks")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if line.lstrip().startswith(("sys.path.insert", "sys.path.append", "sys.path[:0]"))]
    assert edits == []
