"""Which instruction-set level each family of CPU kernels runs at: one registry, the level
chosen once per process (and logged once, with why), the same switch for a person and a test.

A family is a set of kernels that share their levels: the bfloat16 linears
(bf16_matmul.py), the quantized products (quant_matmul.py), ... Each declares, in the
module that wraps its C source, a `Family`:
- `levels`: its level names, lowest first; a level's index is the code its C functions take
  (so the order is the C enum's). Every family has "portable" first and, on x86, an "avx2"
  level beside its best one: a CPU without the best instruction set never falls to the
  portable C where a SIMD level exists;
- `env`: the environment switch that forces a level ("auto", or unset, is the CPU's best);
- `best`: the name of the library's C function that answers the index of the best level
  this CPU runs (asked once; a library that did not build answers portable);
- `requires`: the instruction sets each level above portable needs, for the logs and the
  test summary;
- `others`, `auto`: choices besides the levels (the bfloat16 linears' "onednn") and what
  "auto" means when it is not simply the best level;
- `clamp`: whether a forced level above the CPU's best runs the best instead (the
  quantized products, as they always have) or is refused with the reason (the default:
  a test that forces a level must get that level or hear why not).
and calls `register(family)` at import. To add a family, declare and register it in its
wrapper module and add that module's name to FAMILY_MODULES below, so `families()` (the
logs, the test summary) sees it without anyone importing it first.

One switch covers every family at once: PAGEDKV_CPU_LEVEL=avx2 (or portable), "run as a CPU
of that level would" (baseline.py; it also builds the library for that level's
architecture, x86-64-v3 or x86-64, so the code outside the levels is that CPU's too). Where
a family's own switch is unset, the family runs what its `auto` runs on a CPU whose best
level is the family's highest not above PAGEDKV_CPU_LEVEL's (every family's "avx2" on x86
at avx2); a family's own switch, `auto` included, overrides it.

`choose(name)` gives the level's (or other choice's) name: the switches read each call (a
test sets them with monkeypatch), each distinct answer computed and logged once per process.
The test suite's summary line (tests/conftest.py) reports, per family, the levels a test
forced by its switch in this process and the levels this CPU cannot run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Mapping

import structlog

from model_service.cpu_kernels import baseline
from model_service.cpu_kernels.build import load, loaded_arch

log = structlog.get_logger()

# The modules that register a family (imported by families()).
FAMILY_MODULES = ("model_service.cpu_kernels.bf16_matmul", "model_service.cpu_kernels.f32_matmul",
                  "model_service.cpu_kernels.quant_matmul",
                  "model_service.cpu_kernels.paged_decode", "model_service.cpu_kernels.prefill_attention",
                  "model_service.cpu_kernels.kv_write", "model_service.cpu_kernels.lora_sgmv")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    env: str
    levels: tuple[str, ...]
    best: str
    requires: Mapping[str, str] = dataclasses.field(default_factory=dict)
    others: tuple[str, ...] = ()
    auto: Callable[[str], str] | None = None  # the best level's name -> what "auto" runs
    clamp: bool = False

    @property
    def choices(self) -> tuple[str, ...]:
        return ("auto", *self.levels, *self.others)


_families: dict[str, Family] = {}
_forced: dict[str, set[str]] = {}  # family -> levels a switch forced in this process


def register(family: Family) -> Family:
    if family.levels[:1] != ("portable",):
        raise ValueError(f"{family.name}: the lowest level must be portable, got {family.levels}")
    _families[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    for module in FAMILY_MODULES:
        importlib.import_module(module)
    return tuple(_families.values())


@functools.cache
def best(name: str) -> int:
    """The index of the best level of `name` this CPU runs (asked of the library once)."""
    library = load()
    return 0 if library is None else int(getattr(library, _families[name].best)())


def requested(name: str) -> str:
    family = _families[name]
    return os.environ.get(family.env, "").strip().lower() or "auto"


def switches() -> tuple[str, ...]:
    """Every environment switch of the levels: each family's and the process-wide two."""
    return (*(family.env for family in families()), baseline.LEVEL_ENV, baseline.ARCH_ENV)


def choose(name: str) -> str:
    """The level (or other choice) family `name` runs: its switch's, else PAGEDKV_CPU_LEVEL's
    (capped at the CPU's best), else the CPU's best. ValueError for an unknown choice, or a
    level above the CPU's where the family refuses."""
    family = _families[name]
    if os.environ.get(family.env, "").strip():
        return _choose(name, requested(name), None)
    return _choose(name, "auto", baseline.level())


def chosen_index(name: str) -> int | None:
    """The index of the level family `name` runs, or None where one of its other choices
    (torch's or oneDNN's product) serves, or where the library did not build (a bad switch
    is refused even then)."""
    family = _families[name]
    if load() is None:
        if requested(name) not in family.choices:
            raise ValueError(f"{family.env}={requested(name)!r}: expected one of {', '.join(family.choices)}")
        return None
    choice = choose(name)
    return family.levels.index(choice) if choice in family.levels else None


def forced() -> dict[str, set[str]]:
    """Per family, the levels its switch forced in this process."""
    return {name: set(levels) for name, levels in _forced.items()}


def missing(family: Family) -> tuple[str, ...]:
    """The family's levels this CPU lacks the instruction sets for."""
    return family.levels[best(family.name) + 1:]


def _capped(family: Family, ceiling: str) -> int:
    """The index of the family's highest level that this CPU runs and that is not above
    `ceiling` (baseline.LEVEL_ORDER's order; portable at least)."""
    return max(index for index, level in enumerate(family.levels[:best(family.name) + 1])
               if index == 0 or baseline.rank(level) <= baseline.rank(ceiling))


@functools.cache
def _choose(name: str, asked: str, ceiling: str | None) -> str:
    """`asked`: the family's switch ("auto" where unset); `ceiling`: PAGEDKV_CPU_LEVEL's level
    where the family's switch is unset (None otherwise, or where it is unset too)."""
    family = _families[name]
    if asked not in family.choices:
        raise ValueError(f"{family.env}={asked!r}: expected one of {', '.join(family.choices)}")
    top = family.levels[best(name)]
    lacking = family.levels[best(name) + 1:]
    cpu = f"the CPU's best ({top}" + (f"; it lacks {family.requires.get(lacking[0], lacking[0])})" if lacking else ")")
    if ceiling is not None:
        as_if = family.levels[_capped(family, ceiling)]
        choice = family.auto(as_if) if family.auto is not None else as_if
        why = (f"{baseline.LEVEL_ENV}={ceiling} and {family.env} unset: "
               + (f"{as_if}, below {cpu}" if as_if != top else cpu)
               + ("" if choice == as_if else f"; auto on a CPU whose best level is {as_if}")
               + f"; the library built for {loaded_arch() or 'nothing (not loaded)'}")
    elif asked == "auto":
        choice = family.auto(top) if family.auto is not None else top
        why = cpu if choice == top else f"auto on a CPU whose best level is {top}"
    elif asked in family.levels and family.levels.index(asked) > best(name):
        if not family.clamp:
            raise ValueError(f"{family.env}={asked}: this CPU runs {top} at best "
                             f"({asked} needs {family.requires.get(asked, asked)})")
        choice, why = top, f"{family.env}={asked}, above {cpu}"
    else:
        choice, why = asked, f"{family.env}={asked}"
    if (asked != "auto" or ceiling is not None) and choice in family.levels:
        _forced.setdefault(name, set()).add(choice)
    log.info("cpu kernel level", family=name, chosen=choice, why=why)
    return choice


__all__ = ["FAMILY_MODULES", "Family", "best", "choose", "chosen_index", "families", "forced", "missing", "register",
           "requested", "switches"]
