"""``trioserve engine-core``: an engine-core process that joins an API server at its handshake
address. Until the worker processes land, the only executor is the deterministic reference one."""

from __future__ import annotations

import trio

from trioserve.engine.core import EngineCore, EngineCoreConfig
from trioserve.engine.executor import ReferenceExecutor
from trioserve.engine.shell import run_engine_process
from trioserve.launch.process import set_title, setup_logging


async def _main(config: EngineCoreConfig, step_time: float) -> None:
    sched = config.scheduler
    executor = ReferenceExecutor(sched.num_blocks, sched.block_size, config.vocab_size, step_time)
    await run_engine_process(lambda ctx: EngineCore(config, executor, ctx).run())


def run_engine_core(config: EngineCoreConfig, step_time: float, log_level: str) -> int:
    set_title("EngineCore" if config.engine_index == 0 else f"EngineCore_DP{config.engine_index}")
    setup_logging(log_level)
    trio.run(_main, config, step_time)
    return 0
