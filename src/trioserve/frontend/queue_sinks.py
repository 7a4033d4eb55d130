"""Sinks for transports that are written by a task: the ASGI path and WebSocket.

Each keeps framed bytes in a list until its writer takes them. "Backlogged" means the writer has not
taken them yet, so deltas that arrive meanwhile are merged by the response (one-slot collector).
"""

from __future__ import annotations

import msgspec

from trioserve.frontend.sinks import Sink
from trioserve.sync import Waker


class SseQueueSink(Sink):
    """SSE bytes for a streamed ASGI response, or one full body."""

    __slots__ = ("body", "chunks", "ended", "status")

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[bytes] = []
        self.ended = False
        self.status = 0
        self.body = b""

    @property
    def backlogged(self) -> bool:
        return bool(self.chunks)

    def events(self, payloads: list[bytes]) -> None:
        self.chunks += [b"data: %b\n\n" % p for p in payloads]
        self.waker.set()

    def end(self) -> None:
        self.chunks.append(b"data: [DONE]\n\n")
        self.ended = True
        self.waker.set()

    def full(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body
        self.ended = True
        self.waker.set()

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


class WsSink(Sink):
    """One request on a WebSocket. Messages (documented in docs/websocket.md):
    ``{"type":"chunk","id":ID,"data":CHUNK}``, ``{"type":"done","id":ID}``,
    ``{"type":"response","id":ID,"data":BODY}``, ``{"type":"error","id":ID,"status":S,"error":{...}}``.
    """

    __slots__ = ("_id", "_outbox", "finished")

    def __init__(self, outbox: list[bytes], writer: Waker, request_tag: str) -> None:
        super().__init__(writer)
        self._outbox = outbox
        self._id = msgspec.json.encode(request_tag)
        self.finished = False

    @property
    def backlogged(self) -> bool:
        return bool(self._outbox)

    def events(self, payloads: list[bytes]) -> None:
        tag = self._id
        self._outbox += [b'{"type":"chunk","id":%b,"data":%b}' % (tag, p) for p in payloads]
        self.waker.set()

    def end(self) -> None:
        self._outbox.append(b'{"type":"done","id":%b}' % self._id)
        self.finished = True
        self.waker.set()

    def full(self, status: int, body: bytes) -> None:
        if status == 200:
            self._outbox.append(b'{"type":"response","id":%b,"data":%b}' % (self._id, body))
        else:
            error = msgspec.json.decode(body)["error"]
            message = b'{"type":"error","id":%b,"status":%d,"error":%b}'
            self._outbox.append(message % (self._id, status, msgspec.json.encode(error)))
        self.finished = True
        self.waker.set()
