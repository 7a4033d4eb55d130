"""The fast path's sink: SSE over HTTP/1.1 written straight to a non-blocking socket.

h11 owns the connection's state: it produces the response head and the terminating chunk, and it has
decided the body framing (chunked for HTTP/1.1 peers, close-delimited for HTTP/1.0). Between the two,
each SSE event is framed as one chunk by ``protocol/sse.py`` (its rules say why not by h11).

Writes are ``socket.send`` calls that never block: whatever the kernel does not take stays in
``_buf`` and wakes the connection task, which waits for the socket to become writable and drains it.
"""

from __future__ import annotations

import socket

import h11
import trio

from trioserve.frontend.edge.sinks import InterruptWaker, Sink
from trioserve.protocol import sse
from trioserve.protocol.sse import EVENT_CHUNK, EVENT_FRAMING


def send_or_buffer(sock: socket.socket, buf: bytearray, data: bytes) -> bool | None:
    """Write ``data`` without blocking, keeping order: behind bytes already buffered, else straight to
    the kernel, with what it does not take appended to ``buf``. Returns True when a backlog has just
    started (the owner wakes its drain task), False when there is nothing new to do (all sent, or
    queued behind a backlog the drain task already knows of), None when the peer is gone."""
    if buf:
        buf += data
        return False
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError:
        return None
    if sent < len(data):
        buf += memoryview(data)[sent:]
        return True
    return False


async def send_all(sock: socket.socket, data: bytes) -> bool:
    """Write all of ``data`` to a non-blocking socket, waiting while it is full; False when the peer
    is gone. For the few writes that may wait (responses off the hot path, a closing frame)."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        except OSError:
            return False
        view = view[sent:]
    return True


class HttpSink(Sink):
    __slots__ = ("_buf", "_chunked", "_conn", "_extra", "_head_sent", "_sock", "status")

    def __init__(
        self, sock: socket.socket, conn: h11.Connection, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        """``headers``: added to the response's head, whichever it is (the edge's CORS and
        X-Request-Id); read once per response, never per event."""
        self.waker: InterruptWaker = InterruptWaker()
        super().__init__(self.waker)
        self._sock = sock
        self._conn = conn
        self._buf = bytearray()
        self._head_sent = False
        self._chunked = conn.their_http_version != b"1.0"
        self._extra = headers or []
        self.status = 0  # the response's status once its head is out (for the access log)

    @property
    def backlogged(self) -> bool:
        return bool(self._buf)

    @property
    def backlog_bytes(self) -> int:
        """Gauge: bytes written but not yet taken by the kernel (the peer is behind)."""
        return len(self._buf)

    @property
    def started(self) -> bool:
        return self._head_sent

    def _head(self) -> bytes:
        self._head_sent = True
        self.status = 200
        headers = sse.HEADERS + self._extra if self._extra else sse.HEADERS
        return self._conn.send(h11.Response(status_code=200, headers=headers)) or b""

    def events(self, payloads: list[bytes]) -> None:
        data = sse.events(payloads, self._chunked)
        self._write(data if self._head_sent else self._head() + data)

    def event(self, payload: bytes) -> None:
        if self._chunked and self._head_sent:
            # The per-token path: ``sse.event_chunk`` inlined (no call per token).
            self._write(EVENT_CHUNK % (len(payload) + EVENT_FRAMING, payload))
        else:
            self.events([payload])

    def end(self) -> None:
        head = b"" if self._head_sent else self._head()
        self._write(head + sse.done(self._chunked) + (self._conn.send(h11.EndOfMessage()) or b""))

    def full(self, status: int, body: bytes, *, close: bool = False, retry_after: int | None = None) -> None:
        conn = self._conn
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:  # e.g. a 413 sent before the body was read: the connection cannot be reused
            headers.append((b"connection", b"close"))
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        headers += self._extra
        self._head_sent = True
        self.status = status
        data = (conn.send(h11.Response(status_code=status, headers=headers)) or b"") + (
            conn.send(h11.Data(data=body)) or b""
        )
        self._write(data + (conn.send(h11.EndOfMessage()) or b""))
        self.waker.set()

    def _write(self, data: bytes) -> None:
        if self.closed:
            return
        backlog = send_or_buffer(self._sock, self._buf, data)
        if backlog is None:
            self.closed = True
        if backlog is not False:
            self.waker.set()  # the connection task drains the rest (or sees the peer gone)

    async def flush(self) -> None:
        """Wait until every buffered byte is in the kernel (or the peer is gone)."""
        while self._buf and not self.closed:
            await trio.lowlevel.wait_writable(self._sock)
            try:
                sent = self._sock.send(self._buf)
            except BlockingIOError:
                continue
            except OSError:
                self.closed = True
                return
            del self._buf[:sent]
