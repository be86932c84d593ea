"""Settings the whole test process needs before anything imports grpc."""

import os

# The tests start service processes with a preexec_fn (PR_SET_PDEATHSIG), so Popen
# really forks; with gRPC's fork support on, its pre-fork handler waits for gRPC's own
# threads to quiesce, and a test hung there for minutes (seen in test_multi_tenant, the
# parent stuck in fork() inside cygrpc's atfork handler). The child only sets its death
# signal and execs, so it needs none of that support.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"


# Imported after the setting above: they import grpc.
import dataclasses  # noqa: E402

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
    from harness.processes import start_cache_service, start_model_service

    tmp_path = tmp_path_factory.mktemp("smollm2")
    with start_cache_service(tmp_path, "--kv-cache-bytes", "64MiB", "--host-cache-bytes", "32MiB",
                             "--disk-cache-dir", tmp_path / "disk-tier", "--disk-cache-bytes", "128MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", "smollm2", "--max-model-len", "512",
                                "--max-batch-prefill-tokens", "512", timeout_s=600) as model, \
            grpc.insecure_channel(model.address) as channel:
        yield SmolLM2Stack(model_pb2_grpc.ModelServiceStub(channel), cache, model)


@pytest.hookimpl(wrapper=True)
def pytest_terminal_summary(terminalreporter):
    """One line a CPU kernel family (cpu_kernels/levels.py), after the other summaries: the
    levels this run's tests forced by the family's switch, and the levels skipped because
    this CPU lacks them. Only where the kernel library was loaded in this process: the line
    asks it for the CPU's best levels, and a run that touched no kernel should not build it
    to say so."""
    import sys

    result = yield

    _remote_kv_backends_line(terminalreporter)
    build = sys.modules.get("model_service.cpu_kernels.build")
    if build is None or build._library is None:
        reason = build.load_error() if build is not None else None
        terminalreporter.write_line(f"cpu kernel levels: none run in this process{f' ({reason})' if reason else ''}")
        return result
    from model_service.cpu_kernels import levels

    forced = levels.forced()
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
    return result


REMOTE_KV_BACKEND_MODULES = {"valkey": "tests/test_remote_kv.py", "mooncake": "tests/test_remote_kv_mooncake.py"}


def _remote_kv_backends_line(terminalreporter) -> None:
    """Which remote KV stores the run's tests ran against (a test passed in the backend's
    module), and why one was skipped; nothing where neither module ran."""
    reports = [report for outcome in ("passed", "failed", "skipped") for report in terminalreporter.stats.get(outcome, [])
               if getattr(report, "nodeid", "")]
    parts = []
    for backend, module in REMOTE_KV_BACKEND_MODULES.items():
        mine = [report for report in reports if report.nodeid.split("::")[0].endswith(module.removeprefix("tests/"))]
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
