"""Admission: request ids unique among live requests, the queue limit, keys in arrival
order, and ids that come free again when their request ends. Many threads admit at once
in the server, so the last test races them."""

from __future__ import annotations

import threading

import pytest

from model_service.engine.admission import Admission, DuplicateRequest, QueueFull


def test_keys_come_in_arrival_order_and_ids_free_on_release():
    admission = Admission(max_queued=4)
    first, second = admission.admit("a"), admission.admit("b")
    assert second > first and admission.pending == 2
    with pytest.raises(DuplicateRequest, match="'a' is already queued or running"):
        admission.admit("a")
    assert admission.pending == 2  # a refused request takes no place
    admission.release("a", first)
    assert admission.pending == 1 and admission.keys_of(["a", "b"]) == [second]
    assert admission.admit("a") > second  # the id is free again, under a new key


def test_queue_limit_refuses_then_admits_after_a_release():
    admission = Admission(max_queued=2)
    keys = [admission.admit(name) for name in ("a", "b")]
    with pytest.raises(QueueFull, match="2 requests are queued or running, the limit is --max-queued-requests 2"):
        admission.admit("c")
    admission.release("b", keys[1])
    admission.admit("c")
    assert admission.pending == 2


def test_keys_of_names_each_live_request_once():
    admission = Admission(max_queued=4)
    key = admission.admit("a")
    assert admission.keys_of(["a", "a", "missing"]) == [key]


def test_concurrent_admits_never_pass_the_limit_or_share_a_key():
    admission = Admission(max_queued=50)
    admitted: list[int] = []
    refused = []
    barrier = threading.Barrier(8)

    def admit_many(thread: int) -> None:
        barrier.wait()
        for i in range(20):
            try:
                admitted.append(admission.admit(f"{thread}-{i}"))
            except QueueFull:
                refused.append((thread, i))

    threads = [threading.Thread(target=admit_many, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 50 and len(set(admitted)) == 50 and len(refused) == 8 * 20 - 50
    assert admission.pending == 50
