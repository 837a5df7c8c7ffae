"""AsyncEngine: the step loop in its own thread, streamed to asyncio. Streams, aborts (blocks freed at
once), duplicate ids, the waiting-queue cap, and a dead loop that fails pending requests instead of
hanging them. Every wait is bounded."""

from __future__ import annotations

import asyncio
import time

import pytest

from tideserve import AsyncEngine, SamplingParams
from tideserve.engine.async_engine import EngineDeadError, QueueFullError
from tideserve.engine.llm_engine import EngineArgs

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
MEDIUM = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def make(shared_model):
    engines: list[AsyncEngine] = []

    def build(max_queue: int | None = None, **kwargs) -> AsyncEngine:
        args = EngineArgs(dtype="float32", max_model_len=256, num_blocks=32, **kwargs)
        engine = AsyncEngine.from_loaded(args, *shared_model(args), max_queue=max_queue, log_stats_interval=None)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown(5)


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_generate_streams_cumulative_outputs(make):
    engine = make()

    async def go():
        outs = [out async for out in engine.generate("The capital of France is", SHORT, request_id="a")]
        return outs

    outs = run(go())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 4
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(outs[-1].outputs[0].text.startswith(o.outputs[0].text) for o in outs)
    assert engine.num_active() == 0 and engine.is_healthy


def test_concurrent_requests_and_duplicate_ids(make):
    engine = make(max_num_seqs=8)

    async def go():
        stream = await engine.add_request("Once upon a time", LONG, request_id="dup")
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            await engine.add_request("Hello", SHORT, request_id="dup")
        results = await asyncio.gather(*(_last(engine.generate(f"Count to {i}:", SHORT)) for i in range(6)))
        stream.abort()
        tail = [out async for out in stream]
        return results, stream, tail

    results, stream, tail = run(go())
    assert all(len(r.outputs[0].token_ids) == 4 for r in results)
    assert stream.aborted and not any(o.finished for o in tail)  # outputs of steps before the abort
    assert engine.num_active() == 0


async def _last(gen):
    last = None
    async for out in gen:
        last = out
    return last


def test_abort_and_early_exit_free_blocks(make):
    engine = make()
    kv = engine.engine.kv_manager
    total = kv.num_free_blocks

    async def go():
        gen = engine.generate("Once upon a time", LONG, request_id="early")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()  # leaving the loop (a client disconnect) aborts the request
        await wait_for(lambda: kv.num_free_blocks == total and engine.num_active() == 0)
        stream = await engine.add_request("Once upon a time", LONG, request_id="aborted")
        await stream.__anext__()
        engine.abort("aborted")
        rest = [out async for out in stream]
        await wait_for(lambda: kv.num_free_blocks == total)
        return rest

    assert all(not out.finished for out in run(go()))


def test_validation_errors_reach_the_caller(make):
    engine = make()

    async def go():
        with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
            await engine.add_request([1] * 300, SHORT)
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await engine.add_request("", SHORT)

    run(go())
    assert engine.is_healthy and engine.num_active() == 0


def test_queue_cap(make):
    engine = make(max_queue=1, max_num_seqs=1)

    async def go():
        running = await engine.add_request("Once upon a time", LONG)
        await running.__anext__()
        waiting = await engine.add_request("Hello", SHORT)
        with pytest.raises(QueueFullError, match="max_queue=1"):
            await engine.add_request("Hello again", SHORT)
        running.abort()
        return await _last(waiting)

    assert run(go()).finished


def test_dead_loop_fails_pending_requests(make):
    engine = make()

    async def go():
        stream = await engine.add_request("Once upon a time", LONG)
        await stream.__anext__()

        def broken_step():
            raise RuntimeError("device lost")

        engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("Hello", SHORT)

    run(go())
    assert not engine.is_healthy and isinstance(engine.dead_error, RuntimeError)


def test_shutdown_fails_pending_requests(make):
    engine = make()

    async def go():
        stream = await engine.add_request("Once upon a time", LONG)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    run(go())


def test_idle_engine_thread_shrinks_the_pool_without_steps(shared_model):
    """The pool's upkeep runs on a timer in the engine thread: an idle engine gives memory back although
    no step runs."""
    args = EngineArgs(dtype="float32", max_model_len=256, kv_cache_shrink_delay=0.2, enable_prefix_caching=False)
    engine = AsyncEngine.from_loaded(args, *shared_model(args), log_stats_interval=None)
    try:
        inner = engine.engine
        floor = inner.pool.min_blocks

        async def burst():
            async def one(i):
                return [o async for o in engine.generate(f"Tell me about ship number {i}", MEDIUM)][-1]
            return await asyncio.gather(*(one(i) for i in range(12)))

        outs = run(burst(), timeout=120)
        assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
        grown = inner.kv_manager.num_blocks
        assert grown > floor
        steps = [0]
        step = inner.step
        inner.step = lambda: (steps.__setitem__(0, steps[0] + 1), step())[1]
        deadline = time.monotonic() + 0.2 + 5
        while inner.kv_manager.num_blocks > floor:
            assert time.monotonic() < deadline, f"still {inner.kv_manager.num_blocks} blocks (floor {floor})"
            time.sleep(0.05)
        # The snapshot follows too: the engine thread takes it right after the shrink, so wait for it as well.
        while engine.stats().kv_cache_pool_blocks != floor:
            assert time.monotonic() < deadline, f"the snapshot still says {engine.stats().kv_cache_pool_blocks} blocks"
            time.sleep(0.01)
        assert steps[0] == 0
    finally:
        engine.shutdown(5)
