"""The engine core proper, as the shell runs it (``engine/core_api.py``): the pure scheduler with its
KV ledger, and the executor that runs each ``SchedulerOutput`` (a worker process over shared memory,
or the in-process reference executor).

A step is the scheduler's two verbs around one forward: ``schedule`` → ``executor.execute`` →
``update_from_output``.

Aborts are held and applied at the start of ``schedule`` and of ``update``, never in the middle of a
step, so the scheduler's state does not change under a running forward: an abort that arrives during
the forward lands right after it, before that step's outputs are made (the scheduler then skips the
aborted requests' results; their blocks are freed at the abort), and one that arrives between steps
lands before the next step is chosen.

Thread reports: the latest ``WorkerThreads`` of the workers (in ``WorkerReady``, then in a step's
``StepResult`` when it changed) is kept encoded and set on every ``stats()`` (``EngineStats.worker_threads``).
Only the output rank reports; under tensor parallelism its report stands for every rank (each computes
its count the same way, from the core set and quota the engine core's process tree shares), rank
number aside.

Wall-clock times (the requests' "queued", "scheduled" and "preempted" events) are read here and passed
in: the scheduler reads no clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from trioserve.engine.executor import Executor, ExecutorFailed
from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.protocol.messages import AddRequest, EngineReady, EngineStats, RequestOutput
from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.thread_report import NO_WORKER_THREADS, WorkerThreads, encode_worker_threads
from trioserve.protocol.worker_messages import StepResult


class SchedulerCore:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        *,
        vocab_size: int,
        kind: str = "reference",
        threads: WorkerThreads | None = None,
        ranks: int = 1,
    ) -> None:
        self.scheduler = Scheduler(config)
        # Read per step (a test may swap it before the first one); it reports failures while idle.
        self.executor = executor
        self._wake: Callable[[], None] = lambda: None
        executor.on_failure = self._executor_failed
        self.kind = kind  # what executes the steps, as the handshake reports it
        self.vocab_size = vocab_size
        self._step: SchedulerOutput | None = None
        self._sampled: StepResult | dict[str, list[int]] = {}
        self._aborts: list[str] = []
        self._ranks = ranks
        self._threads = NO_WORKER_THREADS
        if threads is not None:
            self._set_threads(threads)

    def _set_threads(self, report: WorkerThreads) -> None:
        reports = [msgspec.structs.replace(report, rank=rank) for rank in range(self._ranks)]
        self._threads = encode_worker_threads(reports)

    def ready(self, engine_index: int, pid: int) -> EngineReady:
        config = self.scheduler.config
        return EngineReady(
            engine_index=engine_index,
            pid=pid,
            kind=self.kind,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            vocab_size=self.vocab_size,
            num_kv_blocks=config.num_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )

    def _executor_failed(self) -> None:
        self._wake()

    def wake_on_failure(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def failure(self) -> ExecutorFailed | None:
        return self.executor.failure

    def add(self, add: AddRequest) -> RequestOutput | None:
        return self.scheduler.add_request(add, time.time())

    def abort(self, request_ids: list[str]) -> None:
        self._aborts += request_ids

    def client_requests(self, client_index: int) -> list[str]:
        return [rid for rid, r in self.scheduler.requests.items() if r.client_index == client_index]

    def _apply_aborts(self) -> None:
        if self._aborts:
            self.scheduler.abort(self._aborts)
            self._aborts = []

    def schedule(self) -> int | None:
        self._apply_aborts()
        scheduler = self.scheduler
        if not scheduler.has_work:
            return None
        step = scheduler.schedule(time.time())
        if step.is_empty:
            return None
        self._step = step
        return step.total_num_scheduled_tokens

    async def execute(self) -> None:
        assert self._step is not None, "execute() without schedule()"
        self._sampled = await self.executor.execute(self._step)

    def update(self) -> dict[int, list[RequestOutput]]:
        step, self._step = self._step, None
        assert step is not None, "update() without schedule()"
        result, self._sampled = self._sampled, {}
        self._apply_aborts()  # those that arrived during the forward: before its outputs
        if isinstance(result, StepResult):
            if result.threads is not None:
                self._set_threads(result.threads)
            return self.scheduler.update_from_output(
                step, result.sampled, result.logprobs, result.prompt_logprobs
            )
        return self.scheduler.update_from_output(step, result)

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        stats.worker_threads = self._threads
        return stats
