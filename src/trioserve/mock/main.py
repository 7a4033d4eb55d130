"""``trioserve mock-engine``: the mock engine core as its own process."""

from __future__ import annotations

import trio

from trioserve.config import MockEngineConfig
from trioserve.engine.shell import run_engine_process
from trioserve.launch.process import set_title, setup_logging
from trioserve.mock.engine import MockEngine


async def _main(config: MockEngineConfig) -> None:
    await run_engine_process(lambda ctx: MockEngine(config, ctx).run())


def run_mock_engine(config: MockEngineConfig) -> int:
    set_title("EngineCore" if config.engine_index == 0 else f"EngineCore_DP{config.engine_index}")
    setup_logging(config.log_level)
    trio.run(_main, config)
    return 0
