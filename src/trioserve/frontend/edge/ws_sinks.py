"""Sinks for WebSocket requests.

``WsSink`` writes one request's messages to its socket's ``WsWriter`` (``ws_server.WsConnection``:
non-blocking sends from the output handler, no task wakeup per message). "Backlogged" means earlier
bytes still wait for the peer, so deltas that arrive meanwhile are merged by the response (one-slot
collector).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import msgspec

from trioserve.frontend.edge.sinks import Sink
from trioserve.protocol.ws_frames import CHUNK, done_message, error_message, response_message
from trioserve.runtime.sync import Waker


class WsWriter(ABC):
    """One WebSocket's outgoing messages, shared by every request on the socket. ``send`` never
    blocks; ``backlogged`` is True while earlier messages are still waiting for the peer, and then
    every request on the socket merges its deltas. The transport frames each JSON message."""

    __slots__ = ()

    @property
    @abstractmethod
    def backlogged(self) -> bool:
        """True while earlier messages are still waiting for the peer."""

    @abstractmethod
    def send(self, message: bytes) -> None:
        """One JSON text message."""

    def send_many(self, messages: list[bytes]) -> None:
        for message in messages:
            self.send(message)


class _NoWake(Waker):
    """WebSocket sinks have no task to wake when a response finishes: the socket's writer is woken
    by the writer itself when it has bytes waiting."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_WAKE = _NoWake()


class WsSink(Sink):
    """One request on a WebSocket: its output as the messages of docs/websocket.md (``chunk``s, then
    one final ``done``, ``response`` or ``error``; ``protocol/ws_frames.py`` writes them).
    ``on_final`` is called once the final message is written.
    """

    __slots__ = ("_id", "_on_final", "_out", "finished", "request_id")

    def __init__(
        self, out: WsWriter, request_tag: str, on_final: Callable[[WsSink], None] | None = None
    ) -> None:
        super().__init__(_NO_WAKE)
        self._out = out
        self.request_id = request_tag
        self._id = msgspec.json.encode(request_tag)
        self._on_final = on_final
        self.finished = False

    @property
    def backlogged(self) -> bool:
        return self._out.backlogged

    def event(self, payload: bytes) -> None:
        self._out.send(CHUNK % (self._id, payload))  # ``chunk_message``, inlined: the per-token path

    def events(self, payloads: list[bytes]) -> None:
        tag = self._id
        self._out.send_many([CHUNK % (tag, p) for p in payloads])

    def end(self) -> None:
        self._out.send(done_message(self._id))
        self._final()

    def full(self, status: int, body: bytes) -> None:
        if status == 200:
            self._out.send(response_message(self._id, body))
        else:
            self._out.send(error_message(self._id, status, body))
        self._final()

    def _final(self) -> None:
        self.finished = True
        if self._on_final is not None:
            self._on_final(self)
