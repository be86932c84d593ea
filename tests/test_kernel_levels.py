"""The level switch every kernel family shares (cpu_kernels/levels.py), checked once for all
of them: what a person may write in PAGEDKV_*_KERNELS, and what each choice runs."""

from __future__ import annotations

import pytest

from model_service.cpu_kernels import levels, load

FAMILIES = levels.families()

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel library did not build (no C compiler?)")


@pytest.fixture(params=FAMILIES, ids=[family.env for family in FAMILIES])
def family(request, monkeypatch) -> levels.Family:
    monkeypatch.delenv(request.param.env, raising=False)
    return request.param


def test_every_level_the_cpu_runs_is_forced_by_its_name(family, monkeypatch):
    for index, name in enumerate(family.levels[:levels.best(family.name) + 1]):
        monkeypatch.setenv(family.env, name)
        assert levels.chosen_index(family.name) == index


def test_auto_or_unset_runs_the_cpus_best_unless_the_family_says_otherwise(family, monkeypatch):
    top = family.levels[levels.best(family.name)]
    expected = family.auto(top) if family.auto is not None else top
    assert levels.choose(family.name) == expected
    monkeypatch.setenv(family.env, "AUTO ")  # case and spaces as a shell might leave them
    assert levels.choose(family.name) == expected


def test_the_other_choices_run_no_c_level(family, monkeypatch):
    for other in family.others:
        monkeypatch.setenv(family.env, other)
        assert levels.chosen_index(family.name) is None


def test_an_unknown_choice_is_refused_with_the_list(family, monkeypatch):
    monkeypatch.setenv(family.env, "sse9")
    with pytest.raises(ValueError, match=f"{family.env}='sse9': expected one of {', '.join(family.choices)}"):
        levels.chosen_index(family.name)


def test_a_level_above_the_cpus_is_refused_or_clamped_as_the_family_declares(family, monkeypatch):
    best = levels.best(family.name)
    for name in family.levels[best + 1:]:
        monkeypatch.setenv(family.env, name)
        if family.clamp:
            assert levels.chosen_index(family.name) == best
        else:
            with pytest.raises(ValueError, match=f"this CPU runs {family.levels[best]} at best"):
                levels.chosen_index(family.name)


def test_every_family_has_an_avx2_level_on_x86():
    """A CPU without a family's best instruction set never falls to the portable C."""
    assert all("avx2" in family.levels for family in FAMILIES)
