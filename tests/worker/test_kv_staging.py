"""The loads' staging buffers: a buffer given back serves the next load that fits (the same memory, no
fresh pages), a larger load gets a new one, and at most ``keep`` buffers stay, the largest."""

from __future__ import annotations

import numpy as np

from tideserve.worker.kv_staging import StagingBuffers


def test_a_buffer_given_back_serves_the_next_load_that_fits():
    staging = StagingBuffers(keep=2)
    first = staging.take(4, 8)
    assert first.shape == (4, 8) and first.dtype == np.uint8
    staging.give_back(first[1:3])  # a view of it: the whole buffer is kept
    again = staging.take(3, 8)
    assert again.shape == (3, 8) and np.shares_memory(again, first)
    bigger = staging.take(5, 8)
    assert not np.shares_memory(bigger, first)


def test_at_most_keep_buffers_stay_the_largest():
    staging = StagingBuffers(keep=2)
    buffers = [staging.take(n, 8) for n in (1, 3, 2)]
    for buf in buffers:
        staging.give_back(buf)
    assert np.shares_memory(staging.take(3, 8), buffers[1])
    assert np.shares_memory(staging.take(1, 8), buffers[2])  # the smallest (1 row) was dropped
    assert not any(np.shares_memory(staging.take(1, 8), b) for b in buffers)
