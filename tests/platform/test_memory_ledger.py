"""The memory ledger through which engines sharing one memory limit see each other's claims: visible
across engines and processes, gone with the engine or the process, and decided under one lock, so
engines racing for the same headroom never claim more than there is between them."""

from __future__ import annotations

import gc
import json
import multiprocessing
import time

import pytest

from tideserve.platform import memory_ledger
from tideserve.platform.memory_ledger import MemoryLedger

MiB = 2**20


def test_claims_are_seen_by_the_other_engines_not_by_their_own(tmp_path):
    a, b = MemoryLedger("cgroup:/x", tmp_path), MemoryLedger("cgroup:/x", tmp_path)
    other_scope = MemoryLedger("cgroup:/y", tmp_path)
    a.set_claim(300 * MiB)
    b.set_claim(100 * MiB)
    assert (a.others(), b.others(), other_scope.others()) == (100 * MiB, 300 * MiB, 0)
    a.set_claim(50 * MiB)  # a fall is published at once
    assert b.others() == 50 * MiB
    a.set_claim(50 * MiB + MiB)  # a small rise is not worth a rewrite of the file
    assert b.others() == 50 * MiB and a.claim == 51 * MiB
    a.close()
    assert b.others() == 0
    b.set_claim(10 * MiB)
    del b
    gc.collect()  # an engine collected without closing its ledger withdraws its claim
    assert other_scope.others() == 0 and json.loads((tmp_path / MemoryLedger("cgroup:/x", tmp_path).path.name)
                                                    .read_text()) == {}


def test_a_claim_not_renewed_expires(tmp_path, monkeypatch):
    a, b = MemoryLedger("host", tmp_path), MemoryLedger("host", tmp_path)
    a.set_claim(200 * MiB)
    now = time.time()
    monkeypatch.setattr(memory_ledger.time, "time", lambda: now + memory_ledger.CLAIM_TTL_S + 1)
    assert b.others() == 0  # its engine stopped renewing it: gone without closing


def _claim_in_child(path: str, ready, release) -> None:
    ledger = MemoryLedger("host", __import__("pathlib").Path(path))
    ledger.set_claim(123 * MiB)
    ready.set()
    release.wait(30)


@pytest.mark.slow
def test_a_claim_lives_as_long_as_its_process(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_claim_in_child, args=(str(tmp_path), ready, release))
    child.start()
    try:
        assert ready.wait(60)
        here = MemoryLedger("host", tmp_path)
        assert here.others() == 123 * MiB
        release.set()
        child.join(30)
        assert here.others() == 0  # the process is gone (it did not close: interpreter exit withdrew it)
    finally:
        release.set()
        child.join(5)


def _racing_engine(path: str, budget: int, want: int, rounds: int, results) -> None:
    """Decide a growth as the pool controller does: under the lock, read what the others claim, take what
    is left of the budget (at most ``want``), publish it; then let it go and try again."""
    ledger = MemoryLedger("race", __import__("pathlib").Path(path))
    worst = 0
    for _ in range(rounds):
        with ledger.exclusive():
            others = ledger.others()
            take = max(0, min(want, budget - others))
            time.sleep(0.002)  # the decision takes a while: an unlocked ledger would let others in here
            ledger.set_claim(take)
            worst = max(worst, take + ledger.others())
        time.sleep(0.001)
        ledger.set_claim(0)
    results.put(worst)


@pytest.mark.slow  # starts processes
def test_engines_racing_for_one_headroom_never_claim_more_than_it_holds(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    budget, want = 100 * MiB, 70 * MiB  # each alone would take 70 of the 100: two at once must not
    procs = [ctx.Process(target=_racing_engine, args=(str(tmp_path), budget, want, 40, results)) for _ in range(3)]
    for p in procs:
        p.start()
    worst = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert max(worst) <= budget, worst


def test_a_ledger_that_cannot_be_opened_warns_and_claims_nothing(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    ledger = MemoryLedger("host", blocked)  # its file would be inside a regular file
    ledger.set_claim(5 * MiB)
    assert ledger.others() == 0
    assert "cannot be opened" in caplog.text
