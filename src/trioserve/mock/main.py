"""``trioserve mock-engine``: the mock engine core as its own process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import zmq

from trioserve.config import MockEngineConfig
from trioserve.launch.process import exit_on_signals, exit_when_parent_dies, set_title, setup_logging
from trioserve.mock.engine import MockEngine


async def _main(config: MockEngineConfig) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        engine = MockEngine(config, ctx)
        async with trio.open_nursery() as nursery:

            async def cancel_when_done(waiter: Callable[[], Awaitable[None]]) -> None:
                await waiter()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_when_done, exit_on_signals)
            nursery.start_soon(cancel_when_done, exit_when_parent_dies)
            await engine.run()
            nursery.cancel_scope.cancel()
    finally:
        ctx.term()


def run_mock_engine(config: MockEngineConfig) -> int:
    set_title("EngineCore" if config.engine_index == 0 else f"EngineCore_DP{config.engine_index}")
    setup_logging(config.log_level)
    trio.run(_main, config)
    return 0
