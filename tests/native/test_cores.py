"""Cores lent from the native kernels' threads to a background job, and given back once."""

from __future__ import annotations

import threading

import torch

from tideserve.native import cores


def test_a_lent_core_leaves_the_kernels_one_thread_fewer_until_it_comes_back(monkeypatch):
    monkeypatch.setattr(cores.torch, "get_num_threads", lambda: 4)
    assert cores.intra_op_threads() == 4 and cores.lent_cores() == 0
    first, second = cores.lend_core(), cores.lend_core()
    assert cores.intra_op_threads() == 2 and cores.lent_cores() == 2
    worker = threading.Thread(target=first)  # a job's thread gives its core back when it ends
    worker.start()
    worker.join()
    first()  # only the first call counts
    assert cores.intra_op_threads() == 3
    second()
    assert cores.intra_op_threads() == 4 and cores.lent_cores() == 0


def test_the_kernels_keep_at_least_one_thread(monkeypatch):
    monkeypatch.setattr(cores.torch, "get_num_threads", lambda: 1)
    give_back = cores.lend_core()
    try:
        assert cores.intra_op_threads() == 1
    finally:
        give_back()
    assert cores.lent_cores() == 0 and torch.get_num_threads() >= 1
