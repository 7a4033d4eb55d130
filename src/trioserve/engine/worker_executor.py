"""The engine core's side of the workers: spawn them, feed each step through the shared-memory ring,
read the output rank's answer, and turn every way a worker can fail into an ``ExecutorFailed`` the busy
loop reports, never a hang (design §8).

How a failure is seen:

- the worker raised: it says so (``WorkerFailed``) on the result ring before exiting;
- the worker died (killed, crashed in C): EOF on a ring's doorbell pipe surfaces as ``WriterDied`` /
  ``ReaderDied`` in whichever read or write is waiting, and the watcher task notices the exit even when
  the engine is idle;
- the worker hangs: a step that takes longer than ``step_timeout`` seconds.

``open_worker_executor`` is an async context manager: it starts each worker with one ``WorkerLaunch``
value (``python -m trioserve worker --launch JSON``), yields once every worker has loaded the model (so
the engine core can size its KV ledger from what the worker allocated) and on exit shuts the workers
down (``WorkerShutdown``, then ``runtime.reaper``: SIGTERM, then SIGKILL) and closes the rings, leaving
nothing behind.

The rings' names leave ``/dev/shm`` as soon as the worker has attached both (``unlink_when_attached``,
the ring's rule 5), long before the model is loaded: from then on a SIGKILL of the worker, of this
process or of both cannot leave a segment behind, since the kernel frees it with its last mapping.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

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

    @classmethod
    def from_config(cls, config: EngineProcessConfig) -> WorkerExecutorConfig:
        """The one place an engine-core process's configuration becomes its worker's."""
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
        )

    @property
    def step_timeout(self) -> float:
        """A worker that takes longer on one step is declared hung."""
        return self.worker.worker_step_timeout

    def launch(self, steps_ring: RingHandle, results_ring: RingHandle, rank: int = 0) -> WorkerLaunch:
        return WorkerLaunch(
            model=self.model,
            worker=self.worker,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            steps_ring=steps_ring,
            results_ring=results_ring,
            rank=rank,
            log_level=self.log_level,
        )


class WorkerExecutor:
    def __init__(
        self,
        config: WorkerExecutorConfig,
        steps: RingWriter,
        results: RingReader,
        proc: trio.Process,
        ready: WorkerReady,
    ) -> None:
        self.config = config
        self.ready = ready
        self._steps = steps
        self._results = results
        self._proc = proc
        self._encoder = msgspec.msgpack.Encoder()
        self._codec = worker_output_codec()
        self.failure: ExecutorFailed | None = None
        self.on_failure: Callable[[], None] = lambda: None  # the engine core wakes its busy loop here
        self._stopping = False

    async def execute(self, step: SchedulerOutput) -> StepResult:
        if self.failure is not None:
            raise self.failure
        try:
            await self._steps.write(self._encoder.encode(WorkerStep(step)))
            with trio.move_on_after(self.config.step_timeout) as scope:
                message = await self._read()
        except (ReaderDied, WriterDied, WriterClosed) as exc:
            raise await self._died(exc) from None
        except MessageTooLarge as exc:  # the slot is sized so that this cannot happen; never truncate
            raise self._fail(f"step {step.step} does not fit the step ring: {exc}") from None
        if scope.cancelled_caught:
            raise self._fail(f"worker 0 took more than {self.config.step_timeout:g} s on step {step.step}")
        if not isinstance(message, StepResult) or message.step != step.step:
            raise self._fail(f"worker 0 answered step {step.step} with {message!r}")
        return message

    async def _read(self) -> WorkerOutput:
        try:
            message = self._codec.decode(await self._results.read())
        except ProtocolError as exc:
            raise self._fail(f"worker 0 sent a bad frame: {exc}") from None
        if isinstance(message, WorkerFailed):
            raise self._fail(f"worker {message.rank} failed: {message.error}")
        return message

    def _fail(self, reason: str) -> ExecutorFailed:
        if self.failure is None:
            log.error("%s", reason)
            self.failure = ExecutorFailed(reason)
            self.on_failure()
        return self.failure

    async def _died(self, exc: Exception) -> ExecutorFailed:
        with trio.move_on_after(1.0):
            await self._proc.wait()
        return self._fail(f"worker 0 died ({_exit_text(self._proc.returncode)}; {exc})")

    async def watch(self) -> None:
        """Reports a worker that exits while the engine core is idle (a busy one sees it in ``execute``)."""
        code = await self._proc.wait()
        if not self._stopping:
            self._fail(f"worker 0 died ({_exit_text(code)})")

    async def shutdown(self) -> None:
        self._stopping = True
        if self._proc.returncode is None and self.failure is None:
            self._steps.try_write(self._encoder.encode(WorkerShutdown()))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def worker_command(launch: WorkerLaunch) -> list[str]:
    return [sys.executable, "-m", "trioserve", "worker", "--launch", launch.to_json()]


@asynccontextmanager
async def open_worker_executor(config: WorkerExecutorConfig) -> AsyncIterator[WorkerExecutor]:
    with (
        ShmRing(
            num_slots=4, slot_size=config.step_slot_bytes, num_readers=1, unlink_when_attached=True
        ) as step_ring,
        ShmRing(
            num_slots=4, slot_size=config.result_slot_bytes, num_readers=1, unlink_when_attached=True
        ) as result_ring,
    ):
        steps, results = step_ring.writer(), result_ring.reader(0)
        with step_ring.handoff_reader(0) as steps_end, result_ring.handoff_writer() as results_end:
            proc = await trio.lowlevel.open_process(
                worker_command(config.launch(steps_end, results_end)),
                stdin=subprocess.DEVNULL,
                pass_fds=(*steps_end.fds, *results_end.fds),
            )
        executor: WorkerExecutor | None = None
        try:
            ready = await _wait_ready(config, results, proc)
            for ring in (step_ring, result_ring):  # the worker attached both: their names are gone
                ring.release_tracking()
            executor = WorkerExecutor(config, steps, results, proc, ready)
            log.info(
                "worker 0 (pid %d) ready on %s in %.1f s with %d KV blocks",
                ready.pid, ready.device, ready.load_seconds, ready.num_blocks,
            )  # fmt: skip
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor.watch)
                try:
                    yield executor
                finally:
                    await executor.shutdown()
                    nursery.cancel_scope.cancel()
        finally:
            # Only a worker that was told to stop (WorkerShutdown) gets a grace period and SIGTERM: one
            # that failed (hung, say) would only wait them out, and one still loading the model (we
            # were cancelled, or it failed to load) was told nothing and has nothing to finish.
            if executor is not None and executor.failure is None:
                await reap(proc, grace=5.0)
            else:
                await reap(proc, term_grace=None)


async def _wait_ready(config: WorkerExecutorConfig, results: RingReader, proc: trio.Process) -> WorkerReady:
    codec = worker_output_codec()
    with trio.move_on_after(config.ready_timeout):
        try:
            message = codec.decode(await results.read())
        except (WriterDied, WriterClosed):
            await proc.wait()
            raise ExecutorFailed(
                f"worker 0 exited while loading {config.model} ({_exit_text(proc.returncode)})"
            ) from None
        except ProtocolError as exc:
            raise ExecutorFailed(f"worker 0 sent a bad frame while loading: {exc}") from None
        if isinstance(message, WorkerReady):
            return message
        if isinstance(message, WorkerFailed):
            raise ExecutorFailed(message.error)
        raise ExecutorFailed(f"worker 0 started with {message!r}")
    raise ExecutorFailed(f"worker 0 did not load {config.model} within {config.ready_timeout:g} s")
