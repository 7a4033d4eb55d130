"""Where a response's bytes go: the transport side of a streamed or full response.

A sink never blocks its caller: the output handler writes a whole engine step's worth of chunks in
one pass without awaiting. A sink that cannot take bytes at once becomes ``backlogged`` and wakes the
task that owns its transport (the connection task for HTTP, a writer task for WebSocket), which drains
it; while it is backlogged the response merges new deltas instead of queueing events (vLLM's
one-slot collector semantics: a slow client gets fewer, larger chunks, never a growing queue).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from trioserve.runtime.sync import Waker

if TYPE_CHECKING:
    from trioserve.frontend.output.responses import Response

T = TypeVar("T")


class InterruptWaker(Waker):
    """A waker for a task that is busy waiting on something else (the HTTP connection task waits
    for the peer's next bytes): ``set`` interrupts that wait, so one task serves both without a
    helper task per request."""

    __slots__ = ("_pending", "_scope")

    def __init__(self) -> None:
        super().__init__()
        self._pending = False
        self._scope: trio.CancelScope | None = None

    def set(self) -> None:
        self._pending = True
        if self._scope is not None:
            self._scope.cancel()

    async def run_until_set(self, fn: Callable[[], Awaitable[T]]) -> T | None:
        """``await fn()``, unless ``set`` was called before or during it (then None)."""
        if not self._pending:
            with trio.CancelScope() as scope:
                self._scope = scope
                try:
                    return await fn()
                finally:
                    self._scope = None
        self._pending = False
        return None


class Sink(ABC):
    """Transport for one response (``responses.ResponseSink`` is what the response needs of it).
    ``event`` payloads are JSON chunk bodies without framing.

    Rule: a transport reports that its peer caught up (or is gone) by calling ``drained``, and only
    that; the sink tells its response, in this one place.
    """

    __slots__ = ("closed", "response", "waker")

    def __init__(self, waker: Waker | None = None) -> None:
        self.waker = waker or Waker()  # several sinks may share one writer's waker (WebSocket)
        self.closed = False  # the peer went away; writes are dropped
        self.response: Response | None = None  # the response writing here (it attaches itself)

    def drained(self) -> None:
        """The peer took every byte written so far, or is gone: the response writes what it merged
        meanwhile (and releases an output handler waiting on it under ``stall``)."""
        if self.response is not None:
            self.response.on_drained()

    @property
    @abstractmethod
    def backlogged(self) -> bool:
        """True while earlier bytes are still waiting for the peer."""

    @property
    def backlog_bytes(self) -> int:
        """Gauge: bytes written here that the peer has not taken yet. 0 where the sink holds none of
        its own (WebSocket sinks share their socket's writer, which counts its bytes itself)."""
        return 0

    @property
    def started(self) -> bool:
        """True once a status line has gone out; before that an error can still be a plain HTTP
        error response instead of an event in a 200 stream."""
        return True

    @abstractmethod
    def events(self, payloads: list[bytes]) -> None:
        """Frame and write streamed chunks, in order, in as few writes as possible."""

    def event(self, payload: bytes) -> None:
        """One streamed chunk (the per-token common case; sinks may make it cheaper)."""
        self.events([payload])

    @abstractmethod
    def end(self) -> None:
        """Write the end of the stream (``data: [DONE]`` for SSE) and wake the owner."""

    @abstractmethod
    def full(self, status: int, body: bytes) -> None:
        """Write a whole JSON response (non-streamed, or an error before streaming began)."""
