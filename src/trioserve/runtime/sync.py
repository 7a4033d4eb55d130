"""Small synchronization primitives shared by the API server and the engine processes."""

from __future__ import annotations

import trio


class Waker:
    """A re-armable event: ``set`` from sync code, ``wait`` in the one task that owns the sink."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()
