"""Process-level helpers: titles, logging, descriptor limits, and watching the parent process."""

from __future__ import annotations

import logging
import os
import resource
import signal
from collections.abc import Awaitable, Callable

import setproctitle
import trio


def set_title(name: str) -> None:
    """Titles are ``trioserve::<Role>`` plus ranks larger than one (design §2)."""
    setproctitle.setproctitle(f"trioserve::{name}")


def rank_title(role: str, dp_rank: int = 0, dp_size: int = 1, tp_rank: int = 0, tp_size: int = 1) -> str:
    """``role`` with the ranks of the dimensions larger than one: ``Worker``, ``EngineCore_DP1``,
    ``Worker_DP1_TP0`` (docs/processes.md)."""
    if dp_size > 1:
        role += f"_DP{dp_rank}"
    if tp_size > 1:
        role += f"_TP{tp_rank}"
    return role


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s [%(process)d %(name)s] %(message)s",
    )


def raise_open_file_limit(log: logging.Logger) -> int:
    """Raise this process's soft limit on open files to its hard limit (each client connection is
    a descriptor; a common default soft limit is 1024), log it, and return the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY in (hard, soft) or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("open-file limit raised from %d to %d (the hard limit)", soft, hard)
    return hard


async def exit_when_parent_dies(interval: float = 0.5) -> None:
    """Returns when the process that started us is gone (we were re-parented)."""
    parent = os.getppid()
    # Polling is the portable way to notice re-parenting; twice a second costs nothing.
    while os.getppid() == parent:  # noqa: ASYNC110
        await trio.sleep(interval)


async def until_first(*waiters: Callable[[], Awaitable[object]]) -> None:
    """Returns as soon as the first of ``waiters`` returns (the others are cancelled)."""
    async with trio.open_nursery() as nursery:

        async def first(waiter: Callable[[], Awaitable[object]]) -> None:
            await waiter()
            nursery.cancel_scope.cancel()

        for waiter in waiters:
            nursery.start_soon(first, waiter)


async def watch_signals(
    stop: trio.Event, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Sets ``stop`` on the first SIGINT or SIGTERM. ``started`` once the handler is in place: start
    it first, so a signal during start-up asks for a shutdown instead of killing the process."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            stop.set()
            return


async def exit_on_signals() -> None:
    """Returns on the first SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
