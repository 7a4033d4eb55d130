"""``trioserve worker``: a worker process, started by its engine core (design §2, §8).

A plain synchronous loop, no event loop: block on the step ring, run the step, and (output rank only)
put the sampled tokens (and any logprobs) on the result ring. The engine core owns this process's lifetime:

- it ends on ``WorkerShutdown``, or when the step ring's writer closes or dies (pipe EOF), or when the
  result ring's reader is found dead while answering, so a worker never outlives its engine core (one
  busy in a step notices when the step ends);
- SIGINT is ignored (a Ctrl-C in the terminal reaches the whole process group; the engine core decides
  when its workers stop), SIGTERM ends it;
- a step that raises is reported as ``WorkerFailed`` with the error before the process exits, so the
  engine core can fail the requests with a reason instead of only seeing an exit code.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import msgspec
import torch
import transformers

from trioserve.models.geometry import KVGeometry
from trioserve.protocol.worker_messages import (
    WorkerFailed,
    WorkerLaunch,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    worker_input_codec,
)
from trioserve.runtime.process import set_title, setup_logging
from trioserve.transport.shm_ring import ReaderDied, RingReader, RingWriter, WriterClosed, WriterDied
from trioserve.worker.model_runner import ModelRunner, RunnerConfig

log = logging.getLogger("trioserve.worker")


def run_worker(launch: WorkerLaunch | str) -> int:
    """The worker process's main: ``launch`` is its ``WorkerLaunch`` (or that value's JSON, as
    ``--launch`` carries it); returns the exit code."""
    if isinstance(launch, str):
        launch = WorkerLaunch.from_json(launch)
    set_title("Worker" if launch.rank == 0 else f"Worker_TP{launch.rank}")
    setup_logging(launch.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # No tqdm bars in the server's log: the runner logs one line saying how long loading took.
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    steps = RingReader.attach(launch.steps_ring)
    results = RingWriter.attach(launch.results_ring) if launch.results_ring is not None else None
    encoder = msgspec.msgpack.Encoder()

    def answer(message: msgspec.Struct) -> None:
        if results is not None:
            results.write_blocking(encoder.encode(message))

    try:
        return _serve(launch, steps, answer)
    except ReaderDied:  # answering: the engine core, the result ring's one reader, is gone
        log.info("worker %d: the engine core is gone; exiting", launch.rank)
        return 0
    finally:
        steps.close()
        if results is not None:
            results.close()


def _serve(launch: WorkerLaunch, steps: RingReader, answer: Callable[[msgspec.Struct], None]) -> int:
    """Load the model, say so, then run steps until told to stop (the return value: the exit code)."""
    try:
        runner = _load(launch)
    except Exception as exc:
        log.exception("worker %d could not load %s", launch.rank, launch.model)
        answer(WorkerFailed(launch.rank, f"loading {launch.model} failed: {exc!r}"))
        return 1
    answer(WorkerReady(launch.rank, os.getpid(), runner.load_seconds, str(runner.device), runner.num_blocks))
    codec = worker_input_codec()
    while True:
        try:
            frame = steps.read_blocking()
        except (WriterClosed, WriterDied):
            log.info("worker %d: the engine core is gone; exiting", launch.rank)
            return 0
        match codec.decode(frame):
            case WorkerShutdown():
                return 0
            case WorkerStep(step=step):
                try:
                    result = runner.run(step)
                except Exception as exc:
                    log.exception("worker %d failed in step %d", launch.rank, step.step)
                    answer(WorkerFailed(launch.rank, f"step {step.step} failed: {exc!r}"))
                    return 1
                answer(result)


def _load(launch: WorkerLaunch) -> ModelRunner:
    worker = launch.worker
    device = worker.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = worker.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    threads = worker.worker_threads or max(1, (os.cpu_count() or 2) - 1)
    geometry = KVGeometry.from_model_dir(launch.model)
    num_blocks = launch.num_blocks or geometry.blocks_for(launch.kv_cache_bytes, launch.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"{launch.kv_cache_bytes} bytes of KV cache hold no block of {launch.block_size}")
    return ModelRunner.load(RunnerConfig(launch.model, num_blocks, launch.block_size, device, dtype, threads))
