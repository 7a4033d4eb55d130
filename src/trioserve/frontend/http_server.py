"""The API server's own accept loop and HTTP/1.1 fast path for the generation routes.

Every connection is read with h11 (sans-I/O; no HTTP parsing by hand). A request for a generation
route is served here: the output handler writes its events straight to the socket (``HttpSink``).
Anything else hands the connection, with every byte read so far, to hypercorn serving the quart-trio
app, which owns it from then on. One port serves every route.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import h11
import trio

from trioserve.frontend.chunks import Kind
from trioserve.frontend.errors import ApiError
from trioserve.frontend.http_sink import HttpSink
from trioserve.frontend.serving import Serving

log = logging.getLogger("trioserve.http")

FAST_ROUTES: dict[bytes, Kind] = {b"/v1/chat/completions": "chat", b"/v1/completions": "completion"}
_RECV = 65536
_MAX_HEAD = 64 * 1024
_ACCEPT_BATCH = 64
KEEP_ALIVE_TIMEOUT = 5.0  # seconds to wait for the next request head on a connection
BODY_TIMEOUT = 30.0  # seconds to read a request body

Handoff = Callable[[socket.socket, bytes], Awaitable[None]]


class _Closed(Exception):
    """The peer closed the connection (or broke the protocol) between requests."""


class HttpConnection:
    __slots__ = ("_cycle_bytes", "_h11", "_handoff", "_max_body", "_serving", "_sock", "handed_off")

    def __init__(self, sock: socket.socket, serving: Serving, handoff: Handoff, max_body: int) -> None:
        self._sock = sock
        self._serving = serving
        self._handoff = handoff
        self._max_body = max_body
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        self._cycle_bytes = bytearray()  # raw bytes of the current request cycle, for a handoff
        self.handed_off = False

    async def _recv(self) -> bytes:
        while True:
            try:
                data = self._sock.recv(_RECV)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
                continue
            except OSError:
                data = b""
            self._cycle_bytes += data
            self._h11.receive_data(data)
            return data

    async def _next_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._reply_bad_request(exc)
                raise _Closed from None
            if event is h11.NEED_DATA:
                await self._recv()
                continue
            return event

    def internal_error(self) -> None:
        if not self.handed_off and self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = ApiError(500, "internal server error (logged)").body()
            HttpSink(self._sock, self._h11).full(500, body, close=True)

    def _reply_bad_request(self, exc: h11.RemoteProtocolError) -> None:
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            status = exc.error_status_hint
            HttpSink(self._sock, self._h11).full(status, ApiError(status, str(exc)).body(), close=True)

    async def run(self) -> None:
        try:
            while True:
                # An idle or trickling client must not hold a connection task forever (hypercorn and
                # uvicorn close idle keep-alive connections after 5 s too).
                event: object = None
                with trio.move_on_after(KEEP_ALIVE_TIMEOUT):
                    event = await self._next_event()
                if not isinstance(event, h11.Request):
                    return  # timed out, closed, or a protocol state we do not continue from
                path = event.target.split(b"?", 1)[0]
                kind = FAST_ROUTES.get(path) if event.method == b"POST" else None
                if kind is None:
                    self.handed_off = True
                    await self._handoff(self._sock, bytes(self._cycle_bytes))
                    return
                body = None
                with trio.move_on_after(BODY_TIMEOUT):
                    body = await self._read_body(event)
                if body is None:
                    return
                await self._generate(kind, body)
                if self._h11.our_state is not h11.DONE or self._h11.their_state is not h11.DONE:
                    return
                self._h11.start_next_cycle()
                self._cycle_bytes = bytearray(self._h11.trailing_data[0])
        except _Closed:
            return

    async def _read_body(self, request: h11.Request) -> bytes | None:
        """The whole body, or None when the connection cannot go on (too large: a 413 is sent)."""
        for name, value in request.headers:
            if name == b"content-length" and int(value) > self._max_body:
                self._too_large()
                return None
        if self._h11.they_are_waiting_for_100_continue:
            self._sock.sendall(self._h11.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        body = bytearray()
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > self._max_body:
                    self._too_large()
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                return None

    def _too_large(self) -> None:
        msg = f"request body is larger than the limit of {self._max_body} bytes"
        HttpSink(self._sock, self._h11).full(413, ApiError(413, msg).body(), close=True)

    async def _generate(self, kind: Kind, body: bytes) -> None:
        sink = HttpSink(self._sock, self._h11)
        try:
            response = await self._serving.start(kind, body, sink)
        except ApiError as exc:
            sink.full(exc.status, exc.body(), retry_after=exc.retry_after)
            await sink.flush()
            return
        # One task per connection: it parks reading the socket (EOF means the client left; pipelined
        # bytes wait for the next cycle) and the sink interrupts that when it needs the task: to
        # drain a backlog, or because the response is complete.
        try:
            while not (response.done and not sink.backlogged) and not sink.closed:
                if sink.backlogged:
                    await sink.flush()
                    response.on_drained()
                elif await sink.waker.run_until_set(self._recv) == b"":
                    sink.closed = True
        finally:
            if not response.done:
                self._serving.cancel(response)


class HttpServer:
    def __init__(self, serving: Serving, handoff: Handoff, max_body: int) -> None:
        self._serving = serving
        self._handoff = handoff
        self._max_body = max_body
        self.connections = 0
        self._accepting = trio.CancelScope()

    def stop_accepting(self) -> None:
        """Graceful shutdown, step one: no new connections; running ones finish (``serve`` returns
        when they have)."""
        self._accepting.cancel()

    async def serve(
        self, listener: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept until ``stop_accepting``; each connection is a task in this nursery."""
        listener.setblocking(False)
        async with trio.open_nursery() as nursery:
            task_status.started()
            with self._accepting:
                while True:
                    await trio.lowlevel.wait_readable(listener)
                    for _ in range(_ACCEPT_BATCH):
                        try:
                            sock, _ = listener.accept()
                        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                            break
                        nursery.start_soon(self.handle_connection, sock)

    async def handle_connection(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = HttpConnection(sock, self._serving, self._handoff, self._max_body)
        self.connections += 1
        try:
            await conn.run()
        except Exception:
            # A bug must cost one connection, never the server: log it and answer 500 if we still can.
            log.exception("connection handler failed")
            conn.internal_error()
        finally:
            self.connections -= 1
            if not conn.handed_off:
                trio.lowlevel.notify_closing(sock)
                sock.close()
