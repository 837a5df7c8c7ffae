"""The thread count every native kernel call runs with, and cores lent from it to a background job.

Why: on a host whose every core is in the step's OpenMP team, a background job (the elastic pool
committing pages ahead of a growth) takes one core from the team, and each of the team's barriers then
waits for the thread it displaced. Lending a core instead shrinks the team by one for as long as the job
runs: the steps go on with the other cores while the job has one to itself. The count is read at every
kernel call, so a core comes back at the next call after the job ends, mid-step; torch's own count is
left alone (it is per thread in OpenMP, and the job's thread could not give it back).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_lock = threading.Lock()
_lent = 0


def intra_op_threads() -> int:
    """Threads for a native kernel call now: torch's intra-op count less the cores lent out (at least 1)."""
    return max(1, torch.get_num_threads() - _lent)


def lent_cores() -> int:
    return _lent


def lend_core() -> Callable[[], None]:
    """Take one core from the kernels' threads; returns the function that gives it back (any thread may
    call it, and only its first call counts)."""
    global _lent
    with _lock:
        _lent += 1
    returned = False

    def give_back() -> None:
        global _lent
        nonlocal returned
        with _lock:
            if not returned:
                returned = True
                _lent -= 1

    return give_back
