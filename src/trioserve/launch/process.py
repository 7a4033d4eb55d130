"""Process-level helpers: titles, logging, and watching the parent process."""

from __future__ import annotations

import logging
import os
import signal

import setproctitle
import trio


def set_title(name: str) -> None:
    """Titles are ``trioserve::<Role>`` plus ranks larger than one (design §2)."""
    setproctitle.setproctitle(f"trioserve::{name}")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s [%(process)d %(name)s] %(message)s",
    )


async def exit_when_parent_dies(interval: float = 0.5) -> None:
    """Returns when the process that started us is gone (we were re-parented)."""
    parent = os.getppid()
    # Polling is the portable way to notice re-parenting; twice a second costs nothing.
    while os.getppid() == parent:  # noqa: ASYNC110
        await trio.sleep(interval)


async def exit_on_signals() -> None:
    """Returns on the first SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
