"""pagedkv/startup_objects.py and --gc-freeze: once serving, start-up's objects are frozen out
of the garbage collector's full collections (each of which would walk them all with the GIL
held); what requests make afterwards is still collected."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cache_service.api.server import build_parser as cache_parser
from model_service.server import build_parser as model_parser

# In a process of its own: freezing this test process's objects would change every later test's.
PROBE = """
import gc
from pagedkv.startup_objects import freeze_startup_objects
kept = [[i] for i in range(50_000)]              # start-up's: live on (lists: tracked)
garbage = [[] for _ in range(1_000)]
for a, b in zip(garbage, garbage[1:]):
    a.append(b); b.append(a)                       # cycles: gone before freezing
del garbage, a, b
frozen = freeze_startup_objects()
assert frozen >= len(kept), frozen
assert all(o not in gc.get_objects(2) for o in kept[:1])  # no generation holds them now
later = [[] for _ in range(100)]
for a, b in zip(later, later[1:]):
    a.append(b); b.append(a)
del later, a, b                                   # (the loop names held the chain)
assert gc.collect() >= 100                         # made after start-up: still collected
print("ok", frozen)
"""


def test_startup_objects_are_frozen_and_later_cycles_still_collected():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("ok")


@pytest.mark.parametrize("parser", [model_parser, cache_parser], ids=["model_service", "cache_service"])
def test_both_services_freeze_by_default_and_the_flag_turns_it_off(parser, monkeypatch):
    monkeypatch.delenv("PAGEDKV_GC_FREEZE", raising=False)
    assert parser().parse_args([]).gc_freeze == "on"
    assert parser().parse_args(["--gc-freeze", "off"]).gc_freeze == "off"
    with pytest.raises(SystemExit):
        parser().parse_args(["--gc-freeze", "maybe"])
