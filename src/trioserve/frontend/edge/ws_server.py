"""The WebSocket route ``/v1/ws`` (docs/websocket.md): its protocol and its fast path.

``WsSession`` is the protocol of one socket (requests, cancels, ids, final messages). A WebSocket
upgrade of ``/v1/ws`` (the first request on a connection or a later one) is carried here, on the accept
loop's socket, the way the HTTP fast path carries SSE: the output handler writes each message (one
unmasked text frame: ``protocol/ws_frames.py``) with a non-blocking ``send``, so no task wakes per
token. Whatever the kernel does not take waits in the connection's buffer; while it is non-empty every
request on the socket is backlogged and merges its deltas (or queues, stalls, aborts:
``--stream-policy``), and a drain task sends the rest once the socket is writable, then reports the
socket drained (each request's sink lets its merged deltas out). A reader task parses the client's
frames with wsproto (masking, fragments, ping, close), so cancels and EOF are seen even while the
writer is behind.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

import msgspec
import trio
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.utilities import LocalProtocolError

from trioserve.frontend.edge.http_server import RECV_BYTES, WS_PATH, Upgrade
from trioserve.frontend.edge.http_sink import send_all, send_or_buffer
from trioserve.frontend.edge.ws_sinks import WsSink, WsWriter
from trioserve.frontend.output.chunks import Kind
from trioserve.frontend.output.responses import Response
from trioserve.frontend.request.errors import ApiError, error_body
from trioserve.frontend.serving import Serving
from trioserve.protocol.ws_frames import GOING_AWAY, NO_ID, error_message, text_frame, upgrade_response
from trioserve.runtime.sync import Waker

CLOSE_FLUSH = 1.0  # seconds a stopping server spends getting its close frame (and what precedes it) out
READ_PAUSE_BYTES = 256 * 1024  # output waiting for the client beyond which its messages wait too


class WsRequest(msgspec.Struct, tag_field="type", tag="request"):
    id: str
    # Kept as the raw JSON text: ``Serving.start`` decodes it with the route's own schema, so a bad
    # body is an error for this id (not for the socket) and the body is not decoded twice.
    body: msgspec.Raw
    endpoint: str = "chat.completions"


class WsCancel(msgspec.Struct, tag_field="type", tag="cancel"):
    id: str


_decoder = msgspec.json.Decoder(WsRequest | WsCancel)
_ENDPOINTS: dict[str, Kind] = {"chat.completions": "chat", "completions": "completion"}
log = logging.getLogger("trioserve.frontend")


class WsSession:
    """The requests of one socket. ``receive`` handles one client message without awaiting (a request
    is started in ``nursery``: rendering awaits); ``drained`` is called when the socket caught up;
    ``close`` when it is gone (its running requests are cancelled)."""

    def __init__(self, serving: Serving, out: WsWriter, nursery: trio.Nursery) -> None:
        self._serving = serving
        self._out = out
        self._nursery = nursery
        self.running: dict[str, tuple[Response, WsSink]] = {}
        self._starting: dict[str, bool] = {}  # ids being rendered -> cancelled meanwhile

    def receive(self, raw: bytes | str) -> None:
        try:
            msg = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.refuse(400, f"bad message: {exc}")
            return
        except RecursionError:  # msgspec recurses into nested JSON, even to skip over ``body``
            self.refuse(400, "bad message: nested too deeply")
            return
        if isinstance(msg, WsCancel):
            if msg.id in self._starting:
                self._starting[msg.id] = True  # ``_start`` ends it once rendering returns
            entry = self.running.pop(msg.id, None)
            if entry is not None:
                self._serving.cancel(entry[0])
                entry[1].end()
            return
        sink = WsSink(self._out, msg.id, self._finished)
        if msg.id in self.running or msg.id in self._starting:
            error = ApiError(400, f"request id {msg.id!r} is already running on this socket")
            sink.full(error.status, error.body())
            return
        self._starting[msg.id] = False
        self._nursery.start_soon(self._start, msg, sink)

    def refuse(self, status: int, message: str) -> None:
        """An error for a message that names no request (``"id": null``); the socket stays open."""
        self._out.send(error_message(NO_ID, status, error_body(status, message)))

    async def _start(self, msg: WsRequest, sink: WsSink) -> None:
        kind = _ENDPOINTS.get(msg.endpoint)
        try:
            if kind is None:
                raise ApiError(400, f"unknown endpoint {msg.endpoint!r}; use one of {sorted(_ENDPOINTS)}")
            response = await self._serving.start(kind, msgspec.json.encode(msg.body), sink)
        except ApiError as exc:
            sink.full(exc.status, exc.body())
            return
        except Exception:
            # A bug must cost this request only, never the socket's other requests.
            log.exception("starting WebSocket request %r failed", msg.id)
            sink.full(500, error_body(500, "internal server error (logged)"))
            return
        finally:
            cancelled = self._starting.pop(msg.id)
        if cancelled:
            self._serving.cancel(response)
            sink.end()
        elif not response.done:
            self.running[msg.id] = (response, sink)

    def _finished(self, sink: WsSink) -> None:
        entry = self.running.get(sink.request_id)
        if entry is not None and entry[1] is sink:
            del self.running[sink.request_id]

    def drained(self) -> None:
        """The socket caught up: what each request merged meanwhile goes out now."""
        for _, sink in list(self.running.values()):
            sink.drained()

    def close(self) -> None:
        """The socket is gone (its writer drops messages from now on): cancel what still runs."""
        running = list(self.running.values())
        self.running.clear()
        for response, sink in running:
            sink.drained()  # gone counts as drained: releases an output handler waiting on it (``stall``)
            if not response.done:
                self._serving.cancel(response)


class WsConnection(WsWriter):
    """One upgraded socket: the writer its requests share, a reader task and a drain task."""

    __slots__ = ("_buf", "_caught_up", "_max_message", "_serving", "_session", "_sock", "_waker", "closed")

    def __init__(self, sock: socket.socket, serving: Serving, max_request_body_bytes: int) -> None:
        self._sock = sock
        self._serving = serving
        self._buf = bytearray()  # bytes the kernel has not taken yet
        self._waker = Waker()  # wakes the drain task when ``_buf`` fills or the socket failed
        self._caught_up = Waker()  # wakes a paused reader when ``_buf`` fell below READ_PAUSE_BYTES
        self._session: WsSession | None = None
        self._max_message = max_request_body_bytes + 65536
        self.closed = False  # the socket failed: writes are dropped

    @property
    def backlogged(self) -> bool:
        return bool(self._buf)

    @property
    def backlog_bytes(self) -> int:
        """Gauge: bytes written but not yet taken by the kernel (the client is behind)."""
        return len(self._buf)

    def send(self, message: bytes) -> None:
        self._write(text_frame(message))

    def send_many(self, messages: list[bytes]) -> None:
        self._write(b"".join([text_frame(m) for m in messages]))

    def _write(self, data: bytes) -> None:
        if self.closed:
            return
        backlog = send_or_buffer(self._sock, self._buf, data)
        if backlog is None:
            self.closed = True
        if backlog is not False:
            self._waker.set()  # the drain task sends the rest (or sees the peer gone)

    async def run(self, head: bytes, leftover: bytes) -> None:
        """Serve the socket until the client leaves (or the server stops); ``head`` is the 101."""
        self._write(head)
        ws = Connection(ConnectionType.SERVER, trailing_data=leftover)
        peer_done = False
        try:
            async with trio.open_nursery() as nursery:
                self._session = WsSession(self._serving, self, nursery)
                nursery.start_soon(self._drain, nursery.cancel_scope)
                await self._read(ws, self._session)
                peer_done = True
                nursery.cancel_scope.cancel()
        finally:
            if not (peer_done or self.closed):
                # The server is stopping: the close frame goes out behind what is still buffered
                # (the error chunks drain just wrote, say), for at most CLOSE_FLUSH seconds.
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_FLUSH):
                    await send_all(self._sock, bytes(self._buf) + GOING_AWAY)
            self.closed = True
            if self._session is not None:
                self._session.close()

    async def _read(self, ws: Connection, session: WsSession) -> None:
        """Client messages, until a close frame, EOF or a protocol error. A message over the size
        limit is dropped as it arrives (wsproto hands over partial frames) and refused with a 413."""
        text: list[str] = []
        binary = bytearray()
        size = 0
        while True:
            for event in ws.events():
                await self._pause_while_behind()
                if isinstance(event, TextMessage | BytesMessage):
                    size += len(event.data)
                    if size > self._max_message:
                        text.clear()
                        binary.clear()
                    elif isinstance(event, TextMessage):
                        text.append(event.data)
                    else:
                        binary += event.data
                    if not event.message_finished:
                        continue
                    if size > self._max_message:
                        session.refuse(413, f"message is larger than the limit of {self._max_message} bytes")
                    elif isinstance(event, TextMessage):
                        session.receive("".join(text))
                    else:
                        session.receive(bytes(binary))
                    text.clear()
                    binary.clear()
                    size = 0
                elif isinstance(event, Ping):
                    self._write(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    with contextlib.suppress(LocalProtocolError):
                        self._write(ws.send(event.response()))
                    return
            data = await self._recv()
            if not data:
                return
            ws.receive_data(data)

    async def _pause_while_behind(self) -> None:
        """Rule: the reader handles no further client message while ``READ_PAUSE_BYTES`` or more of
        output wait for the client. Streamed deltas merge while the socket is backlogged, but
        replies to client messages (errors, pongs, refusals) do not, so a client that sends and
        never reads would otherwise grow this buffer without bound; paused, it meets TCP's own
        backpressure instead."""
        while len(self._buf) >= READ_PAUSE_BYTES and not self.closed:
            await self._caught_up.wait()

    async def _recv(self) -> bytes:
        while True:
            try:
                return self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
            except OSError:
                return b""

    async def _drain(self, scope: trio.CancelScope) -> None:
        """Sends what the kernel did not take, then lets merged deltas out; ends the connection if
        the socket fails."""
        sock = self._sock
        while not self.closed:
            if not self._buf:
                await self._waker.wait()
                continue
            await trio.lowlevel.wait_writable(sock)
            try:
                sent = sock.send(self._buf)
            except BlockingIOError:
                continue
            except OSError:
                self.closed = True
                break
            del self._buf[:sent]
            if len(self._buf) < READ_PAUSE_BYTES:
                self._caught_up.set()
            if not self._buf and self._session is not None:
                self._session.drained()
        self._caught_up.set()
        scope.cancel()


def websocket_upgrade(serving: Serving, max_request_body_bytes: int) -> Upgrade:
    """The accept loop's ``/v1/ws`` handler: for a valid upgrade, the ``WsConnection`` session to run
    on the same socket (it closes the socket when it ends); None for anything else (nothing written,
    the accept loop answers it)."""

    def upgrade(sock: socket.socket, prefix: bytes) -> Callable[[], Awaitable[None]] | None:
        response = upgrade_response(prefix, WS_PATH)
        if response is None:
            return None

        async def session() -> None:
            try:
                await WsConnection(sock, serving, max_request_body_bytes).run(*response)
            finally:
                trio.lowlevel.notify_closing(sock)
                sock.close()

        return session

    return upgrade
