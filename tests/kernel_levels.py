"""Every level of a CPU kernel this CPU runs, forced through the kernel's switch: a fixture
for the kernel tests, so that each level is checked where it can run (and the portable one
everywhere)."""

from __future__ import annotations

import types

import pytest

from model_service import cpu_kernels


def runnable(module: types.ModuleType) -> list[str]:
    """module's LEVELS up to the best this CPU runs (none without the kernel library)."""
    library = cpu_kernels.load()
    return [] if library is None else list(module.LEVELS[:module.best_level(library) + 1])


def level_fixture(module: types.ModuleType):
    """A fixture, parametrized over the runnable levels, that sets module.ENV to each and
    yields the level's index."""

    @pytest.fixture(params=runnable(module))
    def level(request, monkeypatch):
        monkeypatch.setenv(module.ENV, request.param)
        return module.LEVELS.index(request.param)

    return level
