"""Settings the whole test process needs before anything imports grpc."""

import os

# With gRPC's fork support on, a real fork() runs its pre-fork handler, which waits for
# gRPC's own threads to quiesce: a test hung there for minutes (the parent stuck in fork()
# inside cygrpc's atfork handler). Services start without forking for real (Popen's vfork;
# pagedkv/libc.py, with_parent), but a test that forks a child of its own
# (multiprocessing's "fork") needs none of that support either.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"


# Imported after the setting above: they import grpc.
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402


@dataclasses.dataclass(frozen=True)
class SmolLM2Stack:
    stub: object  # a ModelServiceStub on one channel that lives as long as the stack
    cache: object  # the cache service's ServiceProcess
    model: object  # the model service's ServiceProcess


@pytest.fixture(scope="session")
def smollm2_stack(tmp_path_factory):
    """One SmolLM2-135M-Instruct stack for every test module that reads the real model.

    Starting one costs about a minute of the suite's two cores, so the modules share it;
    each test leaves no block leased, and what one test leaves in the prefix cache is an
    exact hit for another (the same K/V), never a different answer. The pool (64 MiB, about
    1,400 tokens at float32) has a host tier and a disk tier behind it, so a test that
    pushes blocks out of the pool reads them back from the tiers.
    """
    import grpc

    from pagedkv.model.v1 import model_pb2_grpc
    from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service

    tmp_path = tmp_path_factory.mktemp("smollm2")
    with start_cache_service(tmp_path, *SHARED_LEASE_TTL, "--kv-cache-bytes", "64MiB", "--host-cache-bytes", "32MiB",
                             "--disk-cache-dir", tmp_path / "disk-tier", "--disk-cache-bytes", "128MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", "smollm2", "--max-model-len", "512",
                                "--max-batch-prefill-tokens", "512", timeout_s=600) as model, \
            grpc.insecure_channel(model.address) as channel:
        yield SmolLM2Stack(model_pb2_grpc.ModelServiceStub(channel), cache, model)


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' tokenizer and float32 model read from the same GGUF file the stack
    serves (`gguf_file=`): the reference the SmolLM2 modules compare with. Reading it costs
    about half a minute of the suite's two cores (the tokenizer alone a third of that), so
    the modules share one; a test that needs another precision copies the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_service.loading.embedded import embedded_model_path

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return tokenizer, model


SMOLLM2_FIXTURES = ("smollm2_stack", "smollm2_reference")
SMOLLM2_UNIT = "smollm2"  # the one xdist work unit of every module that uses them


def _smollm2_modules() -> frozenset[str]:
    """The test modules that use SMOLLM2_FIXTURES, found by their text: the scheduler sees
    only node ids, in the controller, where no test module is imported."""
    used = re.compile(rf"\b({'|'.join(SMOLLM2_FIXTURES)})\b")  # a whole name: not test_smollm2_stack_...
    here = pathlib.Path(__file__).parent
    return frozenset(path.name for path in here.glob("test_*.py") if used.search(path.read_text()))


def work_unit(nodeid: str, smollm2_modules: frozenset[str]) -> str:
    """--dist loadfile's unit (the test's file), except that the modules using the SmolLM2
    session fixtures are one unit, so one xdist worker runs them all: each worker that ran
    one would start a stack and read the reference of its own, about half a minute of the
    two cores each."""
    path = nodeid.split("::", 1)[0]
    return SMOLLM2_UNIT if pathlib.PurePath(path).name in smollm2_modules else path


# tryfirst: ahead of pytest-xdist's own, which would make the plain loadfile scheduler.
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    smollm2_modules = _smollm2_modules()

    class LoadFileSmolLM2Together(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, smollm2_modules)

    return LoadFileSmolLM2Together(config, log)


_WORKERS_LEVELS = pytest.StashKey[dict]()  # family -> levels forced in any xdist worker


def _kernel_levels_here() -> dict | None:
    """What this process ran of the CPU kernel families: per family, the levels a test
    forced by its switch; None where the kernel library was never loaded here (asking the
    library for the CPU's best levels would build it just to say so)."""
    import sys

    build = sys.modules.get("model_service.cpu_kernels.build")
    if build is None or build._library is None:
        return None
    from model_service.cpu_kernels import levels

    return {name: sorted(forced) for name, forced in levels.forced().items()}


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands what it ran to the controller, which writes the line."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["kernel_levels"] = _kernel_levels_here()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    ran = getattr(node, "workeroutput", {}).get("kernel_levels")
    if ran is not None:
        merged = node.config.stash.setdefault(_WORKERS_LEVELS, {})
        for name, forced in ran.items():
            merged.setdefault(name, set()).update(forced)


@pytest.hookimpl(wrapper=True)
def pytest_terminal_summary(terminalreporter, config):
    """After the other summaries: which remote KV stores the run's tests ran against, then
    one line a CPU kernel family (cpu_kernels/levels.py): the levels this run's tests forced
    by the family's switch (in this process or in any pytest-xdist worker), and the levels
    skipped because this CPU lacks them."""
    import sys

    result = yield

    _remote_kv_backends_line(terminalreporter)
    here = _kernel_levels_here()
    workers = config.stash.get(_WORKERS_LEVELS, None)
    if here is None and workers is None:
        build = sys.modules.get("model_service.cpu_kernels.build")
        reason = build.load_error() if build is not None else None
        terminalreporter.write_line(f"cpu kernel levels: none run in this run{f' ({reason})' if reason else ''}")
        return result
    from model_service.cpu_kernels import levels

    forced: dict[str, set[str]] = {name: set(names) for name, names in (here or {}).items()}
    for name, names in (workers or {}).items():
        forced.setdefault(name, set()).update(names)
    for family in levels.families():
        tested = [name for name in family.levels if name in forced.get(family.name, ())]
        lacking = levels.missing(family)
        untested = [name for name in family.levels if name not in tested and name not in lacking]
        parts = [f"tested {', '.join(tested) or 'none'}"]
        if untested:
            parts.append(f"not forced {', '.join(untested)}")
        if lacking:
            parts.append(f"skipped {', '.join(lacking)} (this CPU lacks "
                         f"{'; '.join(family.requires.get(name, name) for name in lacking)})")
        terminalreporter.write_line(f"cpu kernel levels, {family.name}: {'; '.join(parts)}")
    build = sys.modules["model_service.cpu_kernels.build"]
    if build.loaded_arch() is not None:  # PAGEDKV_CPU_ARCH, PAGEDKV_CPU_LEVEL (cpu_kernels/baseline.py)
        terminalreporter.write_line(f"cpu kernel library: built for -march={build.loaded_arch()}")
    return result


REMOTE_KV_BACKENDS = ("valkey", "mooncake")  # each a marker: the test runs against a real store of that backend


def pytest_configure(config):
    for backend in REMOTE_KV_BACKENDS:
        config.addinivalue_line("markers", f"{backend}: runs against a real {backend} store (the remote KV tier)")


def _remote_kv_backends_line(terminalreporter) -> None:
    """Which remote KV stores the run's tests ran against (a test marked with the backend
    passed), and why one was skipped; nothing where no such test ran."""
    reports = [report for outcome in ("passed", "failed", "skipped") for report in terminalreporter.stats.get(outcome, [])
               if getattr(report, "keywords", None)]
    parts = []
    for backend in REMOTE_KV_BACKENDS:
        mine = [report for report in reports if backend in report.keywords]
        if not mine:
            continue
        if any(report.passed and report.when == "call" for report in mine):
            parts.append(f"{backend} ran")
        else:
            skipped = next((report for report in mine if report.skipped), None)
            reason = skipped.longrepr[2] if skipped is not None and isinstance(skipped.longrepr, tuple) else "no test passed"
            parts.append(f"{backend} not run ({reason})")
    if parts:
        terminalreporter.write_line(f"remote kv backends: {'; '.join(parts)}")
