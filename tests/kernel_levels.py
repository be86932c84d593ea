"""Parameters over a kernel family's levels (cpu_kernels/levels.py) for tests: every level
is collected, those this CPU lacks the instruction sets for are skipped and say so, and a
test forces its level by the family's own switch, as a person would (which the suite's
summary line reports)."""

from __future__ import annotations

import types

import pytest

from model_service.cpu_kernels import levels


def level_params(family: levels.Family) -> list:
    """One pytest.param per level of `family`, id its name, skipped where this CPU lacks it."""
    lacking = levels.missing(family)
    return [pytest.param(name, id=name, marks=pytest.mark.skipif(
        name in lacking, reason=f"this CPU lacks {family.requires.get(name, name)} ({family.name}: {name})"))
        for name in family.levels]


def force(monkeypatch, family: levels.Family, name: str) -> int:
    """Sets the family's switch to level `name`; its index, once levels.choose agrees."""
    monkeypatch.setenv(family.env, name)
    assert levels.choose(family.name) == name
    return family.levels.index(name)


def level_fixture(module: types.ModuleType):
    """A fixture over the levels of the family that `module` (a kernel wrapper) registers,
    forcing each by its switch and yielding the level's index."""

    @pytest.fixture(params=level_params(module.FAMILY))
    def level(request, monkeypatch):
        return force(monkeypatch, module.FAMILY, request.param)

    return level


__all__ = ["force", "level_fixture", "level_params"]
