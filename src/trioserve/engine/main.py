"""``trioserve engine-core`` (and its ``mock-engine`` alias): an engine-core process that joins the API
servers at its handshake address and runs the core its configuration names (``engine.kind``):

- ``model``: the scheduler and KV ledger, with a worker process running the model
  (``engine/worker_executor.py``); the ledger gets exactly the KV blocks the worker allocated;
- ``reference``: the scheduler and KV ledger with the deterministic in-process reference executor,
  ``--num-gpu-blocks-override`` blocks (4096 when 0);
- ``mock``: the mock core (``mock/core.py``).

All three run in the one engine-core shell (``engine/core.py``). ``serve`` starts this process with its
part of the configuration tree as one value (``EngineProcessConfig``); by hand it is built from flags
(``cli.py``). Exit code 0 after ``ShutdownEngine``, a SIGINT/SIGTERM or the parent's death; 1 when the
core failed (a worker died, hung or raised; the API servers were told why). A configuration it cannot
run is refused where it is built (exit code 2, one line, from ``cli.py``).
"""

from __future__ import annotations

import logging
import os

import trio
import zmq

from trioserve.config import EngineProcessConfig
from trioserve.engine.core import EngineCore
from trioserve.engine.executor import ExecutorFailed, ReferenceExecutor
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.engine.worker_executor import WorkerExecutorConfig, open_worker_executor
from trioserve.mock.core import MockCore
from trioserve.runtime.placement import apply_cpu_affinity, cuda_env, parse_device
from trioserve.runtime.process import (
    exit_on_signals,
    exit_when_parent_dies,
    rank_title,
    set_title,
    setup_logging,
    until_first,
)
from trioserve.transport.security import configure_security

log = logging.getLogger("trioserve.engine")

REFERENCE_NUM_BLOCKS = 4096  # the reference executor's KV pool without --num-gpu-blocks-override


def scheduler_config(config: EngineProcessConfig, num_blocks: int) -> SchedulerConfig:
    """The one place the configuration tree becomes the scheduler's own ``SchedulerConfig``;
    ``num_blocks`` is the KV pool (the worker's allocation, or the reference executor's)."""
    engine = config.engine
    return SchedulerConfig(
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=config.model.max_model_len,
        num_blocks=num_blocks,
        block_size=engine.block_size,
        policy=engine.scheduling_policy,
    )


def mock_core(config: EngineProcessConfig) -> MockCore:
    """The mock core the tree describes, on the engine's (trio's) clock."""
    return MockCore.from_config(
        config.model,
        config.engine,
        config.mock,
        current_time=trio.current_time,
        sleep_until=trio.sleep_until,
    )


async def run_engine(config: EngineProcessConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The engine core ``config`` names, from joining to its end (``EngineCore.run``)."""
    engine, model = config.engine, config.model
    match engine.kind:
        case "mock":
            await EngineCore(engine, mock_core(config), ctx).run()
        case "reference":
            sched = scheduler_config(config, engine.num_gpu_blocks_override or REFERENCE_NUM_BLOCKS)
            executor = ReferenceExecutor(
                sched.num_blocks, sched.block_size, model.vocab_size, engine.step_time_us / 1e6
            )
            core = SchedulerCore(sched, executor, vocab_size=model.vocab_size, kind="reference")
            await EngineCore(engine, core, ctx).run()
        case "model":
            worker = WorkerExecutorConfig.from_config(config)
            async with open_worker_executor(worker) as workers:
                sched = scheduler_config(config, workers.ready.num_blocks)
                core = SchedulerCore(
                    sched,
                    workers,
                    vocab_size=model.vocab_size,
                    kind="model",
                    threads=workers.ready.threads,
                    ranks=worker.tensor_parallel_size,
                )
                await EngineCore(engine, core, ctx, step_timeout=worker.step_timeout).run()
        case _:
            raise ValueError(f"no engine core of kind {engine.kind!r}")


async def _main(config: EngineProcessConfig) -> None:
    """The process's top level: the engine with a fresh ZMQ context, until it returns, a SIGINT or
    SIGTERM arrives, or the API server that started us is gone."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        await until_first(lambda: run_engine(config, ctx), exit_on_signals, exit_when_parent_dies)
    finally:
        ctx.destroy(linger=0)


def place(config: EngineProcessConfig) -> None:
    """Put this rank on its device (``engine.device_ids``, one per local rank, by ``engine_index``):
    CPU cores become this process's affinity, which its workers inherit; a GPU becomes the only one
    its workers see. Before any worker starts, so nothing runs elsewhere first."""
    engine = config.engine
    if engine.engine_index >= len(engine.device_ids):
        return
    device = parse_device(engine.device_ids[engine.engine_index])
    if device.kind == "cpu":
        apply_cpu_affinity(device)
    else:
        os.environ.update(cuda_env(device))
    log.info("engine %d placed on %s", engine.engine_index, device)


def run_engine_core(config: EngineProcessConfig) -> int:
    """The engine-core process's main (``python -m trioserve engine-core``): title, logging, then
    the engine until it ends; returns the exit code (the module docstring says which)."""
    engine = config.engine
    set_title(rank_title("EngineCore", engine.engine_index, engine.capacity))
    setup_logging(config.log_level)
    configure_security(engine.engine_secret)
    place(config)
    # What it can run was checked where the configuration was built (cli.engine_process_config).
    failed = False
    try:
        trio.run(_main, config)
    except* ExecutorFailed as group:
        failed = True
        for exc in _leaves(group):
            log.error("engine core stopped: %s", exc)  # noqa: TRY400  (the reason says it all)
    return 1 if failed else 0


def _leaves(group: BaseExceptionGroup[ExecutorFailed]) -> list[BaseException]:
    return [
        e
        for sub in group.exceptions
        for e in (_leaves(sub) if isinstance(sub, BaseExceptionGroup) else [sub])
    ]
