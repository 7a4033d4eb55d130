"""``trioserve worker``: a worker process, started by its engine core (design §2, §8).

A plain synchronous loop, no event loop: block on the step ring, run the step, and (output rank only)
put the sampled tokens on the result ring. The engine core owns this process's lifetime:

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
from dataclasses import dataclass

import msgspec
import torch
import transformers

from trioserve.launch.process import set_title, setup_logging
from trioserve.protocol.worker_messages import (
    StepResult,
    WorkerFailed,
    WorkerReady,
    WorkerShutdown,
    WorkerStep,
    worker_input_codec,
)
from trioserve.transport.shm_ring import ReaderDied, RingReader, RingWriter, WriterClosed, WriterDied
from trioserve.worker.geometry import KVGeometry
from trioserve.worker.model_runner import ModelRunner, RunnerConfig

log = logging.getLogger("trioserve.worker")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str
    steps_ring: str  # RingHandle JSON: this worker's reader end of the step ring
    results_ring: str | None  # RingHandle JSON: the writer end of the result ring (output rank only)
    rank: int = 0
    block_size: int = 16
    num_blocks: int = 0  # 0: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 2 << 30
    device: str = "auto"  # auto: cuda when present, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    num_threads: int = 0  # torch CPU threads; 0: all cores but one (the engine core and API server's)
    log_level: str = "info"


def run_worker(config: WorkerConfig) -> int:
    set_title("Worker" if config.rank == 0 else f"Worker_TP{config.rank}")
    setup_logging(config.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # No tqdm bars in the server's log: the runner logs one line saying how long loading took.
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    steps = RingReader.attach(config.steps_ring)
    results = RingWriter.attach(config.results_ring) if config.results_ring else None
    encoder = msgspec.msgpack.Encoder()

    def answer(message: msgspec.Struct) -> None:
        if results is not None:
            results.write_blocking(encoder.encode(message))

    try:
        return _serve(config, steps, answer)
    except ReaderDied:  # answering: the engine core, the result ring's one reader, is gone
        log.info("worker %d: the engine core is gone; exiting", config.rank)
        return 0
    finally:
        steps.close()
        if results is not None:
            results.close()


def _serve(config: WorkerConfig, steps: RingReader, answer: Callable[[msgspec.Struct], None]) -> int:
    """Load the model, say so, then run steps until told to stop (the return value: the exit code)."""
    try:
        runner = _load(config)
    except Exception as exc:
        log.exception("worker %d could not load %s", config.rank, config.model)
        answer(WorkerFailed(config.rank, f"loading {config.model} failed: {exc!r}"))
        return 1
    answer(WorkerReady(config.rank, os.getpid(), runner.load_seconds, str(runner.device), runner.num_blocks))
    codec = worker_input_codec()
    while True:
        try:
            frame = steps.read_blocking()
        except (WriterClosed, WriterDied):
            log.info("worker %d: the engine core is gone; exiting", config.rank)
            return 0
        match codec.decode(frame):
            case WorkerShutdown():
                return 0
            case WorkerStep(step=step):
                try:
                    sampled = runner.execute(step)
                except Exception as exc:
                    log.exception("worker %d failed in step %d", config.rank, step.step)
                    answer(WorkerFailed(config.rank, f"step {step.step} failed: {exc!r}"))
                    return 1
                answer(StepResult(step.step, sampled))


def _load(config: WorkerConfig) -> ModelRunner:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    threads = config.num_threads or max(1, (os.cpu_count() or 2) - 1)
    geometry = KVGeometry.from_model_dir(config.model)
    num_blocks = config.num_blocks or geometry.blocks_for(config.kv_cache_bytes, config.block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"{config.kv_cache_bytes} bytes of KV cache hold no block of {config.block_size}")
    return ModelRunner.load(RunnerConfig(config.model, num_blocks, config.block_size, device, dtype, threads))
