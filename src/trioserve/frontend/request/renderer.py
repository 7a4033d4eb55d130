"""The renderer pool: chat templates and tokenization on ``--renderer-num-workers`` threads.

Unlike one ``trio.to_thread.run_sync`` per request, a worker that wakes takes every job waiting (up to
``BATCH``) and hands all the results back to the event loop in one ``run_sync_soon``. Under load that
turns a thread wake-up, a GIL hand-over and a loop wake-up per request into one per batch: on a small
VM one trio thread round trip costs ~200 µs of CPU, and each GIL hand-over to a thread can wait for
the busy loop's switch interval. Idle, a job costs the same single round trip as before.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio

BATCH = 32


class _Job:
    __slots__ = ("args", "done", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.result: outcome.Outcome[Any] | None = None
        self.done = trio.Event()


class RendererPool:
    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # Counters for /metrics, counted on the event loop as each batch comes back (not on the
        # threads, where ``+=`` could lose counts): jobs / batches is the batching achieved.
        self.jobs = 0  # renders handed back to their callers
        self.batches = 0  # hand-overs to the event loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the worker threads: started here, stopped (and joined) when this task is cancelled."""
        token = trio.lowlevel.current_trio_token()
        for i in range(self._workers):
            thread = threading.Thread(target=self._work, args=(token,), name=f"trioserve-renderer-{i}")
            thread.start()
            self._threads.append(thread)
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            for _ in self._threads:
                self._jobs.put(None)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()

    async def render(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a renderer thread. If the caller is cancelled, the result is dropped."""
        job = _Job(fn, args)
        self._jobs.put(job)
        await job.done.wait()
        assert job.result is not None
        return job.result.unwrap()

    def _work(self, token: trio.lowlevel.TrioToken) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < BATCH:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)  # leave the stop signal for after this batch
                    break
                batch.append(job)
            for job in batch:
                job.result = outcome.capture(job.fn, *job.args)
            try:
                token.run_sync_soon(self._deliver, batch)
            except trio.RunFinishedError:
                return

    def _deliver(self, batch: list[_Job]) -> None:
        """On the event loop: wake the batch's callers."""
        self.batches += 1
        self.jobs += len(batch)
        for job in batch:
            job.done.set()
