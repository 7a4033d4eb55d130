"""``trioserve engine-core --headless``: this host's engine ranks for API servers on another host
(vLLM's headless mode; docs/remote_engines.md).

It starts ``--data-parallel-size-local K`` engine cores (default 1), ranks ``--data-parallel-start-rank
R`` … ``R + K - 1`` of ``--data-parallel-size D``, each joining the API side at ``--handshake-address``
(``tcp://`` needs ``--engine-secret``), and starts any that exits again after ``RestartBackoff``'s delay
(an engine that exits is the API side's news: its ``EngineDead``, or its silence). SIGTERM/SIGINT stops
them all. It serves nothing itself: ``trioserve::Headless``.
"""

from __future__ import annotations

import logging

import msgspec
import trio

from trioserve.config import EngineProcessConfig
from trioserve.launch.children import child_command
from trioserve.launch.engine_supervisor import RestartBackoff, exit_text
from trioserve.runtime.process import set_title, setup_logging, watch_signals
from trioserve.runtime.reaper import TERM_GRACE, reap

log = logging.getLogger("trioserve")


def headless_ranks(config: EngineProcessConfig) -> range:
    """The ranks this host runs; ValueError when they are not ranks of the data-parallel size."""
    engine = config.engine
    count = 1 if engine.data_parallel_size_local is None else engine.data_parallel_size_local
    ranks = range(engine.data_parallel_start_rank, engine.data_parallel_start_rank + count)
    if count < 1 or ranks.stop > engine.data_parallel_size:
        raise ValueError(
            f"--headless runs ranks {ranks.start}..{ranks.stop - 1}, but --data-parallel-size is "
            f"{engine.data_parallel_size} (ranks 0..{engine.data_parallel_size - 1})"
        )
    return ranks


async def _keep_running(config: EngineProcessConfig, rank: int, stopping: trio.Event) -> None:
    engine = msgspec.structs.replace(config.engine, engine_index=rank, headless=False)
    command = child_command("engine-core", "--config-json", msgspec.structs.replace(config, engine=engine))
    backoff = RestartBackoff()
    while True:
        proc = await command.spawn()
        backoff.joined(trio.current_time())
        log.info("engine rank %d started (pid %d)", rank, proc.pid)
        try:
            await proc.wait()
        finally:
            await reap(proc, grace=0.0, term_grace=TERM_GRACE)
        if stopping.is_set():
            return
        delay = backoff.failed(trio.current_time())
        log.error(
            "engine rank %d (pid %d) %s; starting it again in %.1f s",
            rank,
            proc.pid,
            exit_text(proc.returncode),
            delay,
        )
        await trio.sleep(delay)


async def _headless(config: EngineProcessConfig, ranks: range) -> None:
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        await nursery.start(watch_signals, stop)
        for rank in ranks:
            nursery.start_soon(_keep_running, config, rank, stop)
        await stop.wait()
        log.info("stopping engine ranks %d..%d", ranks.start, ranks.stop - 1)
        nursery.cancel_scope.cancel()  # each rank's reap sends SIGTERM, then SIGKILL


def run_headless(config: EngineProcessConfig) -> int:
    set_title("Headless")
    setup_logging(config.log_level)
    trio.run(_headless, config, headless_ranks(config))
    return 0
