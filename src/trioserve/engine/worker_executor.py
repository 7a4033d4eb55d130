"""The engine core's side of the workers: spawn them, feed each step through the shared-memory ring,
read the output rank's answer, and turn every way a worker can fail into an ``ExecutorFailed`` the busy
loop reports, never a hang (design §8).

With ``-tp N`` (``WorkerConfig.tensor_parallel_size``) the engine core starts ``N`` workers, ranks
``0 … N-1`` of one tensor-parallel group (titles ``Worker_TP<t>``, ``Worker_DP<d>_TP<t>``): all read
the one step ring (``N`` readers; the writer publishes a step once and waits for the slowest
reader's ack before reusing its slot), only rank 0 writes the result ring. The group meets through
a ``torch.distributed`` file store in a private folder this process creates and removes
(``dist_init_method``); the ranks' all-reduces run between the workers themselves.

How a failure is seen, on any rank:

- the worker raised: rank 0 says so (``WorkerFailed``) on the result ring before exiting; another rank
  exits 1 (its peers' next all-reduce fails, and rank 0 reports that);
- a worker died (killed, crashed in C): EOF on a ring's doorbell pipe surfaces as ``WriterDied`` /
  ``ReaderDied`` in whichever read or write is waiting, and a watcher task per worker notices the exit
  even when the engine is idle, or while the step in flight waits on rank 0 (it cancels that wait:
  rank 0 may be stuck in an all-reduce with the dead rank);
- the workers hang: a step that takes longer than ``step_timeout`` seconds.

Any one of these fails the engine: there is no partial group.

``open_worker_executor`` is an async context manager: it starts each worker with one ``WorkerLaunch``
value (``python -m trioserve worker --launch JSON``), yields once every worker has loaded the model
(rank 0 says ready after the group's barrier, with the KV blocks all ranks agreed on, so the engine
core can size its KV ledger from what the workers allocated) and on exit shuts the workers down
(``WorkerShutdown``, read by every rank, then ``runtime.reaper`` on each: SIGTERM, then SIGKILL) and
closes the rings, leaving nothing behind.

The rings' names leave ``/dev/shm`` as soon as every worker has attached both (``unlink_when_attached``,
the ring's rule 5), long before the model is loaded: from then on a SIGKILL of a worker, of this
process or of all of them cannot leave a segment behind, since the kernel frees it with its last
mapping. (The file store's folder is removed on the way out; only a SIGKILL of this process between
its creation and that removal leaves it, an empty folder or a file of a few bytes, in the temp dir.)
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from trioserve.config import EngineProcessConfig, WorkerConfig
from trioserve.engine.executor import ExecutorFailed
from trioserve.protocol.codec import ProtocolError
from trioserve.protocol.ring_layout import RingHandle
from trioserve.protocol.step import SchedulerOutput, step_slot_bytes
from trioserve.protocol.worker_messages import (
    StepResult,
    WorkerFailed,
    WorkerLaunch,
    WorkerOutput,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    step_result_bytes,
    worker_output_codec,
)
from trioserve.runtime.process import rank_title
from trioserve.runtime.reaper import reap
from trioserve.transport.shm_ring import (
    MessageTooLarge,
    ReaderDied,
    RingReader,
    RingWriter,
    ShmRing,
    WriterClosed,
    WriterDied,
)

log = logging.getLogger("trioserve.engine")


@dataclass(frozen=True, slots=True)
class WorkerExecutorConfig:
    model: str  # the Hugging Face folder the worker loads
    worker: WorkerConfig  # the config tree's worker section, passed on whole in ``WorkerLaunch``
    block_size: int
    num_blocks: int  # 0: as many as the worker's KV-cache memory holds
    step_slot_bytes: int = 4 << 20  # one SchedulerOutput, encoded, must fit
    result_slot_bytes: int = 1 << 20
    ready_timeout: float = 300.0  # loading the model
    log_level: str = "info"
    engine_index: int = 0  # this engine core's data-parallel rank, for the workers' titles
    data_parallel_size: int = 1
    tokenizer: str | None = None  # --tokenizer, for structured output; None: the model folder's

    @classmethod
    def from_config(cls, config: EngineProcessConfig) -> WorkerExecutorConfig:
        """The one place an engine-core process's configuration becomes its workers'."""
        model, engine = config.model, config.engine
        if model.model is None:
            raise ValueError("--engine model needs a model folder (the launcher resolves the default)")
        return cls(
            model=model.model,
            worker=config.worker,
            block_size=engine.block_size,
            num_blocks=engine.num_gpu_blocks_override,
            step_slot_bytes=step_slot_bytes(
                engine.max_num_batched_tokens, engine.max_num_seqs, model.max_model_len, engine.block_size
            ),
            result_slot_bytes=step_result_bytes(engine.max_num_batched_tokens, engine.max_num_seqs),
            log_level=config.log_level,
            engine_index=engine.engine_index,
            data_parallel_size=engine.capacity,  # for titles: the ranks the tree is sized for
            tokenizer=model.tokenizer,
        )

    @property
    def step_timeout(self) -> float:
        """A worker that takes longer on one step is declared hung."""
        return self.worker.worker_step_timeout

    @property
    def tensor_parallel_size(self) -> int:
        return self.worker.tensor_parallel_size

    def title(self, rank: int = 0) -> str:
        """Worker ``rank``'s process title: ``Worker``, ``Worker_DP1``, ``Worker_TP0``, ``Worker_DP1_TP0``."""
        return rank_title(
            "Worker", self.engine_index, self.data_parallel_size, rank, self.tensor_parallel_size
        )

    def launch(
        self,
        steps_ring: RingHandle,
        results_ring: RingHandle | None,
        rank: int = 0,
        dist_init_method: str | None = None,
    ) -> WorkerLaunch:
        return WorkerLaunch(
            model=self.model,
            tokenizer=self.tokenizer,
            worker=self.worker,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            steps_ring=steps_ring,
            results_ring=results_ring,
            rank=rank,
            log_level=self.log_level,
            title=self.title(rank),
            tensor_parallel_size=self.tensor_parallel_size,
            dist_init_method=dist_init_method,
        )


class WorkerExecutor:
    """The workers of one engine core (``procs[t]`` is rank ``t``; rank 0 answers)."""

    def __init__(
        self,
        config: WorkerExecutorConfig,
        steps: RingWriter,
        results: RingReader,
        procs: list[trio.Process],
        ready: WorkerReady,
    ) -> None:
        self.config = config
        self.ready = ready
        self._steps = steps
        self._results = results
        self._procs = procs
        self._encoder = msgspec.msgpack.Encoder()
        self._codec = worker_output_codec()
        self.failure: ExecutorFailed | None = None
        self.on_failure: Callable[[], None] = lambda: None  # the engine core wakes its busy loop here
        self._stopping = False
        self._in_flight: trio.CancelScope | None = None  # the running step's wait, while one runs
        self._reported = False  # rank 0 sent WorkerFailed

    async def execute(self, step: SchedulerOutput) -> StepResult:
        if self.failure is not None:
            raise self.failure
        timeout = self.config.step_timeout
        try:
            with trio.CancelScope() as self._in_flight:
                await self._steps.write(self._encoder.encode(WorkerStep(step)))
                with trio.move_on_after(timeout) as scope:
                    message = await self._read()
        except (ReaderDied, WriterDied, WriterClosed) as exc:
            raise await self._died(exc) from None
        except MessageTooLarge as exc:  # the slot is sized so that this cannot happen; never truncate
            raise self._fail(f"step {step.step} does not fit the step ring: {exc}") from None
        finally:
            self._in_flight = None
        if self.failure is not None:  # a rank's watcher cancelled the wait: it died
            raise self.failure
        if scope.cancelled_caught:
            who = "worker 0" if len(self._procs) == 1 else f"the {len(self._procs)} tensor-parallel workers"
            raise self._fail(f"{who} took more than {timeout:g} s on step {step.step}")
        if not isinstance(message, StepResult) or message.step != step.step:
            raise self._fail(f"worker 0 answered step {step.step} with {message!r}")
        return message

    async def _read(self) -> WorkerOutput:
        try:
            message = self._codec.decode(await self._results.read())
        except ProtocolError as exc:
            raise self._fail(f"worker 0 sent a bad frame: {exc}") from None
        if isinstance(message, WorkerFailed):
            self._reported = True  # rank 0 said why it stops: its exit that follows is no news
            if len(self._procs) > 1:
                # Rank 0's failure may be a peer's death seen through an all-reduce: if a peer exits
                # now, its watcher reports that, the cause (and cancels this wait).
                await _first_exit(self._procs[1:], timeout=1.0)
                for rank, proc in enumerate(self._procs[1:], start=1):
                    if proc.returncode is not None:
                        raise self._fail(f"worker {rank} died ({_exit_text(proc.returncode)})")
            raise self._fail(f"worker {message.rank} failed: {message.error}")
        return message

    def _fail(self, reason: str) -> ExecutorFailed:
        if self.failure is None:
            log.error("%s", reason)
            self.failure = ExecutorFailed(reason)
            if self._in_flight is not None:
                self._in_flight.cancel()
            self.on_failure()
        return self.failure

    async def _died(self, exc: Exception) -> ExecutorFailed:
        # ReaderDied names the step ring's reader (the rank); the result ring's writer is rank 0.
        rank = exc.reader_index if isinstance(exc, ReaderDied) else 0
        proc = self._procs[rank]
        with trio.move_on_after(1.0):
            await proc.wait()
        return self._fail(f"worker {rank} died ({_exit_text(proc.returncode)}; {exc})")

    async def watch(self) -> None:
        """Reports a worker that exits while the engine core is idle, or while a step waits on rank 0
        (a busy one sees its own rings' ends in ``execute``)."""
        async with trio.open_nursery() as nursery:
            for rank, proc in enumerate(self._procs):
                nursery.start_soon(self._watch_one, rank, proc)

    async def _watch_one(self, rank: int, proc: trio.Process) -> None:
        code = await proc.wait()
        if not self._stopping and not (rank == 0 and self._reported):
            self._fail(f"worker {rank} died ({_exit_text(code)})")

    async def shutdown(self) -> None:
        self._stopping = True
        running = all(proc.returncode is None for proc in self._procs)
        if running and self.failure is None:
            self._steps.try_write(self._encoder.encode(WorkerShutdown()))


async def _first_exit(procs: list[trio.Process], timeout: float) -> None:
    """Returns when the first of ``procs`` has exited, or after ``timeout`` seconds."""
    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:

            async def one(proc: trio.Process) -> None:
                await proc.wait()
                nursery.cancel_scope.cancel()

            for proc in procs:
                nursery.start_soon(one, proc)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def worker_command(launch: WorkerLaunch) -> list[str]:
    return [sys.executable, "-m", "trioserve", "worker", "--launch", launch.to_json()]


@contextlib.contextmanager
def _rendezvous(tp_size: int) -> Iterator[str | None]:
    """The tensor-parallel group's ``torch.distributed`` init URL: a file store in a private folder
    (mode 0700) that goes when the workers have (None with one worker)."""
    if tp_size == 1:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="trioserve_tp_"))
    log.info("%d tensor-parallel workers meet in %s", tp_size, folder)
    try:
        yield f"file://{folder / 'store'}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@asynccontextmanager
async def open_worker_executor(config: WorkerExecutorConfig) -> AsyncIterator[WorkerExecutor]:
    tp = config.tensor_parallel_size
    with (
        _rendezvous(tp) as init_method,
        ShmRing(
            num_slots=4, slot_size=config.step_slot_bytes, num_readers=tp, unlink_when_attached=True
        ) as step_ring,
        ShmRing(
            num_slots=4, slot_size=config.result_slot_bytes, num_readers=1, unlink_when_attached=True
        ) as result_ring,
    ):
        steps, results = step_ring.writer(), result_ring.reader(0)
        procs: list[trio.Process] = []
        executor: WorkerExecutor | None = None
        try:
            for rank in range(tp):
                with contextlib.ExitStack() as ends:
                    steps_end = ends.enter_context(step_ring.handoff_reader(rank))
                    results_end = ends.enter_context(result_ring.handoff_writer()) if rank == 0 else None
                    fds = (*steps_end.fds, *(results_end.fds if results_end is not None else ()))
                    procs.append(
                        await trio.lowlevel.open_process(
                            worker_command(config.launch(steps_end, results_end, rank, init_method)),
                            stdin=subprocess.DEVNULL,
                            pass_fds=fds,
                        )
                    )
            ready = await _wait_ready(config, results, procs)
            for ring in (step_ring, result_ring):  # every worker attached both: their names are gone
                ring.release_tracking()
            executor = WorkerExecutor(config, steps, results, procs, ready)
            log.info(
                "%s (pid %d) ready on %s in %.1f s with %d KV blocks",
                "worker 0" if tp == 1 else f"{tp} tensor-parallel workers, rank 0", ready.pid,
                ready.device, ready.load_seconds, ready.num_blocks,
            )  # fmt: skip
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor.watch)
                try:
                    yield executor
                finally:
                    await executor.shutdown()
                    nursery.cancel_scope.cancel()
        finally:
            # Only workers that were told to stop (WorkerShutdown) get a grace period and SIGTERM: one
            # that failed (hung, say) would only wait them out, and one still loading the model (we
            # were cancelled, or a rank failed to load) was told nothing and has nothing to finish.
            clean = executor is not None and executor.failure is None
            with trio.CancelScope(shield=True):
                async with trio.open_nursery() as nursery:
                    for proc in procs:
                        if clean:
                            nursery.start_soon(_reap_told, proc)
                        else:
                            nursery.start_soon(_reap_untold, proc)


async def _reap_told(proc: trio.Process) -> None:
    await reap(proc, grace=5.0)


async def _reap_untold(proc: trio.Process) -> None:
    await reap(proc, term_grace=None)


async def _wait_ready(
    config: WorkerExecutorConfig, results: RingReader, procs: list[trio.Process]
) -> WorkerReady:
    """Rank 0's ``WorkerReady`` (sent once every rank has loaded), or ``ExecutorFailed`` as soon as any
    rank exits, rank 0 reports a failure, or ``ready_timeout`` passes."""
    outcome: WorkerReady | ExecutorFailed = ExecutorFailed(
        f"the workers did not load {config.model} within {config.ready_timeout:g} s"
    )
    with trio.move_on_after(config.ready_timeout):
        async with trio.open_nursery() as nursery:

            async def rank0() -> None:
                nonlocal outcome
                outcome = await _ready_message(config, results, procs[0])
                nursery.cancel_scope.cancel()

            async def exits(rank: int, proc: trio.Process) -> None:
                nonlocal outcome
                await proc.wait()
                await trio.sleep(0.5)  # rank 0 may still be saying why (a failure it saw first)
                outcome = ExecutorFailed(
                    f"worker {rank} exited while loading {config.model} ({_exit_text(proc.returncode)})"
                )
                nursery.cancel_scope.cancel()

            nursery.start_soon(rank0)
            for rank, proc in enumerate(procs[1:], start=1):
                nursery.start_soon(exits, rank, proc)
    if isinstance(outcome, ExecutorFailed):
        raise outcome
    return outcome


async def _ready_message(
    config: WorkerExecutorConfig, results: RingReader, proc: trio.Process
) -> WorkerReady | ExecutorFailed:
    codec = worker_output_codec()
    try:
        message = codec.decode(await results.read())
    except (WriterDied, WriterClosed):
        await proc.wait()
        return ExecutorFailed(f"worker 0 exited while loading {config.model} ({_exit_text(proc.returncode)})")
    except ProtocolError as exc:
        return ExecutorFailed(f"worker 0 sent a bad frame while loading: {exc}")
    if isinstance(message, WorkerReady):
        return message
    if isinstance(message, WorkerFailed):
        return ExecutorFailed(message.error)
    return ExecutorFailed(f"worker 0 started with {message!r}")
