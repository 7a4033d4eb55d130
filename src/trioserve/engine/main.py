"""``trioserve engine-core``: an engine-core process that joins an API server at its handshake
address. Until the worker processes land, the only executor is the deterministic reference one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import zmq

from trioserve.engine.core import EngineCore, EngineCoreConfig
from trioserve.engine.executor import ReferenceExecutor
from trioserve.launch.process import exit_on_signals, exit_when_parent_dies, set_title, setup_logging


async def _main(config: EngineCoreConfig, step_time: float) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sched = config.scheduler
    executor = ReferenceExecutor(sched.num_blocks, sched.block_size, config.vocab_size, step_time)
    try:
        async with trio.open_nursery() as nursery:

            async def cancel_when_done(waiter: Callable[[], Awaitable[None]]) -> None:
                await waiter()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_when_done, exit_on_signals)
            nursery.start_soon(cancel_when_done, exit_when_parent_dies)
            await EngineCore(config, executor, ctx).run()
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


def run_engine_core(config: EngineCoreConfig, step_time: float, log_level: str) -> int:
    set_title("EngineCore" if config.engine_index == 0 else f"EngineCore_DP{config.engine_index}")
    setup_logging(log_level)
    trio.run(_main, config, step_time)
    return 0
