"""The model service's glibc malloc settings (model_service/allocator.py): what each flag
calls, that the trimming thread stops, and that bad values are refused with the flags named."""

from __future__ import annotations

import threading

import pytest

from model_service import allocator


class FakeLibc:
    def __init__(self) -> None:
        self.mallopt_calls: list[tuple[int, int]] = []
        self.trims = threading.Semaphore(0)

    def mallopt(self, option: int, value: int) -> int:
        self.mallopt_calls.append((option, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.trims.release()
        return 1


@pytest.fixture
def libc(monkeypatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(allocator, "_libc", lambda: fake)
    return fake


def test_the_arena_limit_is_set_and_the_trimmer_runs_until_stopped(libc):
    stop = threading.Event()
    thread = allocator.configure(2, 0.01, stop=stop)
    assert libc.mallopt_calls == [(allocator.M_ARENA_MAX, 2)]
    assert all(libc.trims.acquire(timeout=30) for _ in range(3)), "malloc_trim was not called every interval"
    stop.set()
    thread.join(30)
    assert not thread.is_alive()


def test_zero_leaves_glibc_alone(libc):
    assert allocator.configure(0, 0) is None
    assert libc.mallopt_calls == [] and not libc.trims.acquire(timeout=0.05)
    assert allocator.configure(4, 0) is None and libc.mallopt_calls == [(allocator.M_ARENA_MAX, 4)]


def test_keeping_free_memory_sets_both_thresholds_capped_where_glibc_caps_them(libc):
    assert allocator.configure(0, 0, 128 << 20) is None
    assert libc.mallopt_calls == [(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD_MAX),
                                  (allocator.M_TRIM_THRESHOLD, 128 << 20)]
    libc.mallopt_calls.clear()
    allocator.configure(0, 0, 1 << 20)
    assert libc.mallopt_calls == [(allocator.M_MMAP_THRESHOLD, 1 << 20), (allocator.M_TRIM_THRESHOLD, 1 << 20)]


def test_negative_values_are_refused_naming_the_flags(libc):
    with pytest.raises(ValueError, match="--malloc-arena-max, --malloc-trim-interval-s and --malloc-keep-free-bytes "
                                         "must be 0"):
        allocator.configure(-1, 0)
    with pytest.raises(ValueError, match="got 0, -1 and 0"):
        allocator.configure(0, -1)
    with pytest.raises(ValueError, match="got 0, 0 and -1"):
        allocator.configure(0, 0, -1)


def test_the_c_library_here_has_both_functions():
    # The suite runs on glibc (Debian); elsewhere configure() logs and skips.
    libc = allocator._libc()
    assert libc is not None and libc.malloc_trim(0) in (0, 1)
