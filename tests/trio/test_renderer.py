"""The renderer pool: results and errors come back to their callers, batched under load."""

from __future__ import annotations

import threading

import pytest
import trio

from trioserve.frontend.request.renderer import RendererPool


async def test_results_errors_and_batching() -> None:
    pool = RendererPool(workers=1)
    gate = threading.Event()
    seen_threads: set[str] = set()

    def work(i: int) -> int:
        seen_threads.add(threading.current_thread().name)
        gate.wait(5)  # hold the first job so the rest queue up behind it
        if i == 3:
            raise ValueError("bad prompt")
        return i * i

    results: dict[int, object] = {}

    async def call(i: int) -> None:
        try:
            results[i] = await pool.render(work, i)
        except ValueError as exc:
            results[i] = exc

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with trio.open_nursery() as callers:
            for i in range(6):
                callers.start_soon(call, i)
            await trio.sleep(0.05)
            gate.set()
        nursery.cancel_scope.cancel()
    assert {i: r for i, r in results.items() if i != 3} == {0: 0, 1: 1, 2: 4, 4: 16, 5: 25}
    assert isinstance(results[3], ValueError)
    assert seen_threads == {"trioserve-renderer-0"}
    assert pool.jobs == 6
    assert pool.batches <= 2  # jobs that queued behind a busy worker came back in one hand-over
    assert not any(t.name.startswith("trioserve-renderer") for t in threading.enumerate())


async def test_a_cancelled_caller_does_not_break_the_pool() -> None:
    pool = RendererPool(workers=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with trio.move_on_after(0.01):
            await pool.render(lambda: threading.Event().wait(0.2))
        assert await pool.render(lambda: "still works") == "still works"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("workers", [1, 3])
async def test_threads_stop_with_the_pool(workers: int) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(RendererPool(workers).run)
        assert sum(t.name.startswith("trioserve-renderer") for t in threading.enumerate()) == workers
        nursery.cancel_scope.cancel()
    assert not any(t.name.startswith("trioserve-renderer") for t in threading.enumerate())
