"""The level switch every kernel family shares (cpu_kernels/levels.py), checked once for all
of them: what a person may write in PAGEDKV_*_KERNELS, and what each choice runs."""

from __future__ import annotations

import pytest

from model_service.cpu_kernels import baseline, levels, load

FAMILIES = levels.families()

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel library did not build (no C compiler?)")


@pytest.fixture(params=FAMILIES, ids=[family.env for family in FAMILIES])
def family(request, monkeypatch) -> levels.Family:
    monkeypatch.delenv(request.param.env, raising=False)
    monkeypatch.delenv(baseline.LEVEL_ENV, raising=False)
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


@pytest.mark.parametrize("ceiling", ["avx2", "portable"])
def test_cpu_level_sets_each_familys_default_to_what_a_cpu_of_that_level_runs(family, monkeypatch, ceiling):
    """PAGEDKV_CPU_LEVEL: where the family's switch is unset, its `auto` on a CPU whose best
    level is the family's highest not above the ceiling (and this CPU's best at most)."""
    monkeypatch.setenv(baseline.LEVEL_ENV, ceiling)
    as_if = family.levels[min(family.levels.index(ceiling), levels.best(family.name))]
    assert levels.choose(family.name) == (family.auto(as_if) if family.auto is not None else as_if)
    for name in family.levels[:levels.best(family.name) + 1]:  # the family's own switch still wins,
        monkeypatch.setenv(family.env, name)
        assert levels.choose(family.name) == name
    monkeypatch.setenv(family.env, "auto")  # "auto" included: the CPU's best
    top = family.levels[levels.best(family.name)]
    assert levels.choose(family.name) == (family.auto(top) if family.auto is not None else top)


def test_cpu_level_runs_the_avx2_level_of_every_family_where_the_cpu_has_it(monkeypatch):
    monkeypatch.setenv(baseline.LEVEL_ENV, "avx2")
    for family in FAMILIES:
        monkeypatch.delenv(family.env, raising=False)
        if levels.best(family.name) >= family.levels.index("avx2"):
            assert levels.choose(family.name) == "avx2"
            assert "avx2" in levels.forced()[family.name]  # the summary line reports it as tested


def test_an_unknown_cpu_level_is_refused(family, monkeypatch):
    monkeypatch.setenv(baseline.LEVEL_ENV, "avx512")
    with pytest.raises(ValueError, match="PAGEDKV_CPU_LEVEL='avx512': expected one of auto, avx2, portable"):
        levels.choose(family.name)
