"""A CPU pool's pages mapped ahead of use (pagedkv/pool_memory/populate.py): after
populating, writing the whole pool takes (almost) no page faults in this process, where
without it every page faults once; the bytes stay what they were."""

from __future__ import annotations

import resource

import pytest
import torch

from pagedkv.pool_memory import populate as populate_module
from pagedkv.pool_memory.populate import populate, populate_in_background
from pagedkv.pool_memory.shm_file import create_shared_pool

SHAPE = (4, 2, 64, 16, 2, 64)  # 4 MiB of float32: 1,024 pages
PAGES = 4 * 2 * 64 * 16 * 2 * 64 * 4 // 4096


# Without populating, nearly every page faults (the kernel may map a neighbour on a fault);
# populated, nearly none does (other threads of the test process may fault meanwhile).
FAULTING = PAGES * 3 // 4
POPULATED = PAGES // 8


def faults_writing(tensor: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensor.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.fixture
def pool(tmp_path):
    with create_shared_pool(SHAPE, torch.float32, directory=str(tmp_path)) as shared:
        yield shared.tensor


def test_writing_a_fresh_pool_faults_once_a_page(pool):
    assert faults_writing(pool) >= FAULTING  # the control: without populating, every page faults


def test_a_populated_pool_takes_no_faults_and_keeps_its_bytes(pool, tmp_path):
    pool.view(-1)[::1024].copy_(torch.arange(pool.numel() // 1024, dtype=torch.float32))  # faults them all
    with create_shared_pool(SHAPE, torch.float32, directory=str(tmp_path)) as fresh:
        fresh.tensor.view(-1)[:5] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
        before = fresh.tensor.clone()
        populated = populate(fresh.tensor)
        if populated == 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
        assert populated == fresh.tensor.nbytes
        assert torch.equal(fresh.tensor, before)
        assert faults_writing(fresh.tensor) < POPULATED


def test_a_kernel_without_it_leaves_the_pool_as_it_was(pool, monkeypatch):
    monkeypatch.setattr(populate_module, "_madvise", lambda *args: -1)
    assert populate(pool) == 0
    assert faults_writing(pool) >= FAULTING


def test_the_background_thread_populates_and_ends(pool):
    thread = populate_in_background(pool)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert faults_writing(pool) < POPULATED
