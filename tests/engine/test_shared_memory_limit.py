"""Engines under one memory limit coordinate through the memory ledger: one engine's claim (memory it is
about to make resident) is taken out of the other's budget, a growth the claims leave no room for is
refused (the engine preempts or waits instead) and the requests still finish with the same answers."""

from __future__ import annotations

import uuid

import pytest

from tideserve import SamplingParams

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

GiB = 2**30
MiB = 2**20
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class SharedLimit:
    """A memory limit two engines read (what a cgroup's headroom is to two servers in it): its free memory
    falls as their pools take pages."""

    def __init__(self, available: int) -> None:
        self.available = available
        self.scope = f"test:{uuid.uuid4()}"  # a ledger of its own: no other test's engines share it
        self.engines: list = []

    def probe(self) -> Probe:
        return Probe(self)

    def kv_bytes(self) -> int:
        return sum(engine.pool.resident_bytes() for engine in self.engines)


class Probe:
    def __init__(self, limit: SharedLimit) -> None:
        self.limit = limit
        self.engine = None  # set once the engine exists: until then it holds no KV

    def available_bytes(self) -> int:
        return self.limit.available - self.limit.kv_bytes()

    def total_bytes(self) -> int:
        return 4 * GiB

    def used_by_process_bytes(self) -> int:
        return GiB + (self.engine.pool.resident_bytes() if self.engine is not None else 0)

    def memory_scope(self) -> str:
        return self.limit.scope

    def describe(self) -> str:
        return "a limit two test engines share"


def on_limit(make_llm, limit: SharedLimit, **settings):
    probe = limit.probe()
    llm = make_llm(memory_probe=probe, **settings)
    probe.engine = llm.engine
    limit.engines.append(llm.engine)
    return llm


def test_a_neighbours_claim_is_not_this_engines_to_take(make_llm):
    limit = SharedLimit(3 * GiB)
    settings = {"dtype": "float32", "max_model_len": 512, "enable_prefix_caching": False}
    a = on_limit(make_llm, limit, **settings)
    b = on_limit(make_llm, limit, **settings)
    assert a.engine.pool.ledger.scope == b.engine.pool.ledger.scope == limit.scope
    prompts = [[(11 * i + 7 * q) % 4000 + 100 for i in range(200)] for q in range(6)]
    want = [o.outputs[0].token_ids for o in make_llm(**settings).generate(prompts, GREEDY)]

    pool = b.engine.pool
    alone = pool._reachable_blocks()
    claim = 1 * GiB
    a.engine.pool.ledger.set_claim(claim)  # A is about to commit a growth of 1 GiB
    assert abs(alone - pool._reachable_blocks() - claim / pool.bytes_per_block) <= 1  # block rounding
    assert b.engine.stats().memory_others_claimed_bytes == claim

    # A claims all but 30 blocks of B's room: B's burst, which alone would grow far past that, stays
    # within it (requests wait for blocks, or are preempted) and still finishes with the same answers.
    a.engine.pool.ledger.set_claim(0)
    start = pool.geometry.num_blocks
    room = pool._reachable_blocks() - start
    need = sum(-(-(len(p) + GREEDY.max_tokens) // pool.geometry.block_size) for p in prompts)
    assert room > need > 30 + start  # alone, the whole burst would fit
    a.engine.pool.ledger.set_claim((room - 30) * pool.bytes_per_block)
    sizes = []
    apply = pool._apply
    pool._apply = lambda geometry: (sizes.append(geometry.num_blocks), apply(geometry))[1]
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sizes and max(sizes) <= start + 30 + 1, (sizes, start)
    assert b.engine.stats().memory_claimed_bytes > 0  # B claims its own activation peak in turn
    a.engine.close()
    assert pool.ledger.others() == 0  # a closed engine claims nothing
