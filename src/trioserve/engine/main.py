"""``trioserve engine-core``: an engine-core process that joins an API server at its handshake address.

With ``--model`` it runs the model on a worker process (engine/worker_executor.py) and sizes its KV
ledger from the blocks the worker allocated; without, it runs the deterministic reference executor.
"""

from __future__ import annotations

import dataclasses
import logging

import trio
import zmq

from trioserve.engine.core import EngineCore, EngineCoreConfig
from trioserve.engine.executor import ExecutorFailed, ReferenceExecutor
from trioserve.engine.shell import run_engine_process
from trioserve.engine.worker_executor import WorkerExecutorConfig, open_worker_executor
from trioserve.launch.process import set_title, setup_logging

log = logging.getLogger("trioserve.engine")


async def _main(config: EngineCoreConfig, worker: WorkerExecutorConfig | None, step_time: float) -> None:
    async def engine(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        if worker is None:
            sched = config.scheduler
            executor = ReferenceExecutor(sched.num_blocks, sched.block_size, config.vocab_size, step_time)
            await EngineCore(config, executor, ctx).run()
            return
        async with open_worker_executor(worker) as workers:
            scheduler = dataclasses.replace(config.scheduler, num_blocks=workers.ready.num_blocks)
            core_config = dataclasses.replace(
                config, scheduler=scheduler, kind="model", step_timeout=worker.step_timeout
            )
            await EngineCore(core_config, workers, ctx).run()

    await run_engine_process(engine)


def run_engine_core(
    config: EngineCoreConfig, worker: WorkerExecutorConfig | None, step_time: float, log_level: str
) -> int:
    set_title("EngineCore" if config.engine_index == 0 else f"EngineCore_DP{config.engine_index}")
    setup_logging(log_level)
    failed = False
    try:
        trio.run(_main, config, worker, step_time)
    except* ExecutorFailed as group:
        failed = True
        for error in _leaves(group):
            log.error("engine core stopped: %s", error)  # noqa: TRY400  (the reason says it all)
    return 1 if failed else 0


def _leaves(group: BaseExceptionGroup[ExecutorFailed]) -> list[BaseException]:
    return [
        e
        for sub in group.exceptions
        for e in (_leaves(sub) if isinstance(sub, BaseExceptionGroup) else [sub])
    ]
