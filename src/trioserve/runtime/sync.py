"""Small synchronization primitives shared by the API server and the engine processes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


class Waker:
    """A re-armable event: ``set`` from sync code, ``wait`` (or ``wait_or``) in the one task that owns
    the sink."""

    __slots__ = ("_event", "_parked")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._parked: trio.CancelScope | None = None  # the owner's ``wait_or``, while it waits

    def set(self) -> None:
        self._event.set()
        if self._parked is not None:
            self._parked.cancel()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()

    async def wait_or(self, other: Callable[[], Awaitable[object]]) -> None:
        """Returns once set, or once ``other()`` returns (a socket's readiness: the owner of a ZMQ
        socket must park on its FD itself). No nursery: ``set`` cancels the wait on ``other``."""
        if not self._event.is_set():
            with trio.CancelScope() as scope:
                self._parked = scope
                try:
                    await other()
                finally:
                    self._parked = None
        self._event = trio.Event()
