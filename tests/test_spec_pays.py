"""spec/pays.py: decode steps go the way, speculating or not, whose whole steps measured more
tokens a second at their batch size, and one step in a while goes the other way so both
rates stay current; the speculator asks it before looking up any proposal."""

from __future__ import annotations

import itertools

from model_service.spec import pays
from model_service.spec.pays import SpeculationPays, bucket
from model_service.spec.settings import SpeculativeSettings
from model_service.spec.speculator import Speculator


def ways(monitor: SpeculationPays, decodes: int, steps: int, speculated_rate: float, plain_rate: float) -> list[bool]:
    """Runs `steps` decode steps whose tokens a second are the given ones by way; the ways taken."""
    taken = []
    for _ in range(steps):
        speculated = monitor.speculate(decodes)
        taken.append(speculated)
        monitor.record(decodes, speculated, decodes, decodes / (speculated_rate if speculated else plain_rate))
    return taken


def test_speculating_is_the_way_until_plain_steps_measure_faster_and_both_are_learned():
    monitor = SpeculationPays()
    taken = ways(monitor, 8, pays.LEARN_EVERY * 3, speculated_rate=100.0, plain_rate=50.0)
    # one step in LEARN_EVERY measures the other way while it learns
    assert taken.count(False) == 3 and taken[0]


def test_where_plain_steps_are_faster_speculation_is_only_probed():
    monitor = SpeculationPays()
    ways(monitor, 8, 200, speculated_rate=300.0, plain_rate=400.0)  # learned
    taken = ways(monitor, 8, pays.PROBE_EVERY * 4, speculated_rate=300.0, plain_rate=400.0)
    assert taken.count(True) == 4
    assert monitor.rate(8, True) < monitor.rate(8, False)


def test_where_speculating_is_faster_plain_steps_are_only_probed_and_a_change_is_followed():
    monitor = SpeculationPays()
    ways(monitor, 1, 200, speculated_rate=120.0, plain_rate=50.0)
    assert ways(monitor, 1, pays.PROBE_EVERY * 2, 120.0, 50.0).count(False) == 2
    # the requests change: proposals stop being kept; the probes see it and the way turns
    ways(monitor, 1, pays.PROBE_EVERY * 40, speculated_rate=40.0, plain_rate=50.0)
    assert ways(monitor, 1, pays.PROBE_EVERY, 40.0, 50.0).count(True) == 1


def test_a_probe_stands_for_the_steps_since_its_way_was_last_measured():
    # Documents (long contexts, proposals kept): plain steps are slow, speculating wins.
    monitor = SpeculationPays()
    ways(monitor, 8, 200, speculated_rate=60.0, plain_rate=50.0)
    # Then free text at short contexts: both ways run faster, plain now the faster. The
    # first plain probe weighs the 31 steps since the last, not one, and the way turns at once.
    after = ways(monitor, 8, pays.PROBE_EVERY * 2, speculated_rate=70.0, plain_rate=100.0)
    assert after[pays.PROBE_EVERY:].count(True) <= 1
    assert monitor.rate(8, False) > 95.0


def test_a_lucky_speculating_probe_does_not_turn_the_way():
    # What a speculating step appends swings with what its proposals hit; its tokens a
    # second average 75 here against plain steps' steady 100.
    monitor, swings, taken = SpeculationPays(), itertools.cycle([40.0, 60.0, 150.0, 50.0]), []
    for _ in range(pays.PROBE_EVERY * 40):
        speculated = monitor.speculate(8)
        taken.append(speculated)
        monitor.record(8, speculated, 8, 8 / (next(swings) if speculated else 100.0))
    later = taken[pays.PROBE_EVERY * 8:]
    assert later.count(True) <= len(later) // pays.PROBE_EVERY + 2  # the probes, hardly more


def test_batch_sizes_are_measured_apart_exactly_then_by_powers_of_two():
    assert [bucket(n) for n in (1, 8, 16, 17, 32, 33, 64, 100)] == [1, 8, 16, 32, 32, 64, 64, 128]
    monitor = SpeculationPays()
    ways(monitor, 8, 200, speculated_rate=300.0, plain_rate=400.0)
    assert monitor.rate(1, True) is None  # nothing measured at one stream


def test_a_batch_size_not_learned_yet_goes_the_way_the_nearest_learned_one_found_faster():
    monitor = SpeculationPays()
    ways(monitor, 8, 200, speculated_rate=300.0, plain_rate=400.0)  # plain faster at 8
    ways(monitor, 2, 200, speculated_rate=300.0, plain_rate=100.0)  # speculating faster at 2
    # 7 and 6 have nothing measured: as 8, plain but for one step in LEARN_EVERY
    assert [monitor.speculate(7) for _ in range(pays.LEARN_EVERY)].count(True) == 1
    assert [monitor.speculate(3) for _ in range(pays.LEARN_EVERY)].count(False) == 1  # as 2


def test_a_step_with_nothing_appended_or_no_time_is_not_counted():
    monitor = SpeculationPays()
    monitor.record(4, True, 0, 0.01)
    monitor.record(4, True, 4, 0.0)
    assert monitor.rate(4, True) is None


def test_the_speculator_asks_before_looking_up_and_always_means_always():
    settings = SpeculativeSettings(method="ngram", num_speculative_tokens=3)
    speculator = Speculator(settings, block_size=16, max_model_len=256)
    ways(speculator.pays, 8, 200, speculated_rate=300.0, plain_rate=400.0)
    assert sum(speculator.looks_up(8) for _ in range(pays.PROBE_EVERY)) == 1
    assert not speculator.looks_up(0)
    always = Speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=3, always=True), 16, 256)
    ways(always.pays, 8, 200, speculated_rate=300.0, plain_rate=400.0)
    assert all(always.looks_up(8) for _ in range(pays.PROBE_EVERY))
