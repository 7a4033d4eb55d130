"""The API server's accept loop and HTTP/1.1 connections: it owns every connection, for every route.

Every connection is read with h11 (sans-I/O; no HTTP parsing by hand) by one task, from its first
byte to its close. A request for a generation route is served here: the output handler writes its
events straight to the socket (``HttpSink``). A WebSocket upgrade of ``/v1/ws`` becomes a WebSocket
connection (``ws_server.py``). Every other request is passed, whole, to the quart-trio app through
``AsgiHost.call``, and the connection goes on to its next request: what came before a request on a
connection never decides which path serves it.

Limits (the same for every route, because this loop reads every request):
- a request head must be complete within ``HEAD_TIMEOUT`` of the connection opening or of the end of
  the previous response (this is also the idle keep-alive timeout); then the connection is closed;
- a head larger than ``MAX_HEAD`` bytes is answered 431, a target longer than ``MAX_TARGET`` 414;
- a body must arrive within ``BODY_TIMEOUT``; one larger than the body limit is answered 413;
- after any error that leaves the request unread, and on ``Connection: close``, the connection closes
  (h11 decides reuse; we never start a next cycle it does not allow).

Before routing, every request head goes through the gate (``access.py``): a CORS preflight is
answered, a protected route without the API key gets 401, and what the gate adds (CORS headers,
the X-Request-Id echo) goes on the response whichever path serves it. Each request that got a
response gets one access-log line at its end (``frontend/access_log.py``); one whose client left
before any response is logged with status 499.

Drain (``HttpServer.drain``): the listener closes at once, idle keep-alive connections are closed,
and a request that still arrives on an open connection gets 503 with ``Connection: close``.
Connection faults (out of file descriptors) never end the accept loop: it closes idle connections
and backs off (``AcceptBackoff``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial

import h11
import trio

from trioserve.config import AccessConfig
from trioserve.frontend.access_log import AccessLog, AccessRecord
from trioserve.frontend.edge.accept_balance import AcceptBalance
from trioserve.frontend.edge.access import REQUEST_ID_HEADER, Gate, Verdict
from trioserve.frontend.edge.asgi_host import AsgiHost
from trioserve.frontend.edge.http_sink import HttpSink, send_all
from trioserve.frontend.output.chunks import Kind
from trioserve.frontend.output.responses import Response
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.serving import Serving
from trioserve.runtime.sync import Waker

log = logging.getLogger("trioserve.http")

FAST_ROUTES: dict[bytes, Kind] = {b"/v1/chat/completions": "chat", b"/v1/completions": "completion"}
WS_PATH = b"/v1/ws"
RECV_BYTES = 65536
MAX_HEAD = 64 * 1024  # bytes of request line and header fields (431 above it)
MAX_TARGET = 8 * 1024  # bytes of request target, path and query (414 above it)
_ACCEPT_BATCH = 64
HEAD_TIMEOUT = 5.0  # seconds for a complete request head (idle keep-alive included)
BODY_TIMEOUT = 30.0  # seconds to read a request body
LINGER = 2.0  # seconds to keep reading (and discarding) after an error reply, before closing
CLIENT_LEFT = 499  # access-log status of a request whose client left before any response (nginx's)
# accept() errors that mean "out of a resource for now", never "stop serving".
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

# For the bytes of a ``GET /v1/ws`` request cycle: the WebSocket session to run on the socket (it owns
# and closes the socket from then on), or None (nothing written) when they are not a valid upgrade.
Upgrade = Callable[[socket.socket, bytes], Callable[[], Awaitable[None]] | None]


class _Closed(Exception):
    """The peer closed the connection (or broke the protocol) between requests."""


class HttpConnection:
    __slots__ = (
        "_cycle_bytes",
        "_h11",
        "_idle_scope",
        "_linger",
        "_request",
        "_server",
        "_sock",
        "_started",
        "upgraded",
    )

    def __init__(self, sock: socket.socket, server: HttpServer) -> None:
        self._sock = sock
        self._server = server
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._cycle_bytes = bytearray()  # raw bytes of the current cycle up to its head, for an upgrade
        self._idle_scope: trio.CancelScope | None = None  # set while waiting for a head, no byte of it read
        self.upgraded = False  # a WebSocket connection owns the socket now
        self._linger = False  # an error reply went out before the request was read: close gently
        self._request: h11.Request | None = None  # the request being served, until its log line
        self._started = 0.0  # wall clock when its head was read

    def close_if_idle(self) -> bool:
        """Close the connection if it waits for a next request of which no byte has arrived."""
        if self._idle_scope is None:
            return False
        self._idle_scope.cancel()
        return True

    async def _recv(self) -> bytes:
        while True:
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._sock)
                continue
            except OSError:
                data = b""
            if self._h11.their_state is h11.IDLE:  # the head (and what came with it) of this cycle
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

    async def _send_all(self, data: bytes) -> None:
        if not await send_all(self._sock, data):
            raise _Closed

    def internal_error(self) -> None:
        if not self.upgraded and self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = ApiError(500, "internal server error (logged)").body()
            HttpSink(self._sock, self._h11).full(500, body, close=True)
            self._log(500)

    def _reply_error(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        """An error response after which the connection closes (its request may be partly unread)."""
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = ApiError(status, message).body()
            HttpSink(self._sock, self._h11).full(status, body, close=True, retry_after=retry_after)
            self._linger = True
            self._log(status)

    async def linger(self) -> None:
        """Before closing after an error reply: a close with unread input makes the kernel send a
        reset, which can destroy the reply before the client reads it. So stop writing, then read
        and discard what the client still sends, for at most ``LINGER`` seconds (RFC 9112 9.6)."""
        if not self._linger:
            return
        with trio.move_on_after(LINGER), contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
            while True:
                try:
                    if not self._sock.recv(RECV_BYTES):
                        return
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(self._sock)

    def _reply_bad_request(self, exc: h11.RemoteProtocolError) -> None:
        self._reply_error(exc.error_status_hint, str(exc))

    async def _next_request(self) -> h11.Request | None:
        """The next request head, or None when the connection should close (timed out, closed,
        drained while idle, or a protocol state we do not continue from)."""
        event: object = None
        with trio.move_on_after(HEAD_TIMEOUT) as deadline:
            buffered, closed = self._h11.trailing_data
            if not buffered and not closed:
                if self._server.draining:
                    return None
                # Idle until the first byte of the next request: ``drain`` may close us here.
                with trio.CancelScope() as idle:
                    self._idle_scope = idle
                    try:
                        await self._recv()
                    finally:
                        self._idle_scope = None
                if idle.cancelled_caught:
                    return None
            event = await self._next_event()
        if deadline.cancelled_caught and self._h11.trailing_data[0]:
            # A head started but did not finish in time (slowloris, a stalled client): say so.
            self._reply_error(408, f"the request head did not arrive within {HEAD_TIMEOUT:g} s")
        return event if isinstance(event, h11.Request) else None

    async def run(self) -> None:
        server = self._server
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                self._request, self._started = request, time.time()
                if not self._within_limits(request):
                    return
                if server.draining:
                    self._reply_error(503, "the server is shutting down", retry_after=1)
                    return
                path = request.target.split(b"?", 1)[0]
                verdict = server.gate.check(request.method, path, request.headers)
                # A refused upgrade (401) is read and answered below, like any other request.
                upgrade = path == WS_PATH and request.method == b"GET" and verdict.reply is None
                if upgrade and server.upgrade is not None:
                    session = server.upgrade(self._sock, bytes(self._cycle_bytes))
                    if session is not None:
                        self.upgraded = True  # from here on the session owns (and closes) the socket
                        try:
                            await session()
                        finally:
                            self._log(101)
                        return
                    self._reply_error(426, "this route needs a WebSocket upgrade (RFC 6455, version 13)")
                    return
                body = None
                with trio.move_on_after(BODY_TIMEOUT) as deadline:
                    body = await self._read_body(request)
                if deadline.cancelled_caught:
                    self._reply_error(408, f"the request body did not arrive within {BODY_TIMEOUT:g} s")
                if body is None:
                    return
                kind = FAST_ROUTES.get(path)
                head_only = request.method == b"HEAD"
                response: Response | None = None
                request_id = verdict.request_id
                if verdict.reply is None and kind is not None and request.method == b"POST":
                    status, response, request_id = await self._generate(kind, body, verdict)
                else:
                    echo: list[tuple[bytes, bytes]] = []
                    if server.gate.echo_request_id:  # the client's own, or a fresh one
                        request_id = request_id or server.serving.new_request_id()
                        echo = [(REQUEST_ID_HEADER, request_id.encode())]
                    if verdict.reply is not None:  # a preflight, a 401
                        reply = verdict.reply
                        status = await self._answer(reply.status, reply.body, reply.headers + echo, head_only)
                    elif kind is not None:
                        message = "The method is not allowed for the requested URL."
                        headers = [(b"allow", b"POST"), *verdict.headers, *echo]
                        status = await self._answer(405, ApiError(405, message).body(), headers, head_only)
                    else:
                        status = await server.asgi.call(
                            request,
                            body,
                            self._h11,
                            self._send_all,
                            client=_address(self._sock.getpeername),
                            server=_address(self._sock.getsockname),
                            headers=verdict.headers + echo,
                        )
                self._log(status, response, request_id)
                if self._h11.our_state is not h11.DONE or self._h11.their_state is not h11.DONE:
                    return
                self._h11.start_next_cycle()
                self._cycle_bytes = bytearray(self._h11.trailing_data[0])
        except _Closed:
            return

    def _within_limits(self, request: h11.Request) -> bool:
        """Refuse (and close) a request whose head is over the documented limits. h11 enforces
        ``MAX_HEAD`` only on a head that is still incomplete; one that arrived whole is measured here."""
        if len(request.target) > MAX_TARGET:
            self._reply_error(414, f"the request target is longer than the limit of {MAX_TARGET} bytes")
            return False
        fields = sum(len(name) + len(value) + 4 for name, value in request.headers)  # ": " and CRLF
        size = len(request.method) + len(request.target) + fields
        if size > MAX_HEAD:
            self._reply_error(431, f"the request head is larger than the limit of {MAX_HEAD} bytes")
            return False
        return True

    async def _read_body(self, request: h11.Request) -> bytes | None:
        """The whole body, or None when the connection cannot go on (too large: a 413 is sent)."""
        max_body = self._server.max_body
        for name, value in request.headers:
            if name == b"content-length" and int(value) > max_body:
                self._too_large(max_body)
                return None
        if self._h11.they_are_waiting_for_100_continue:
            go_on = h11.InformationalResponse(status_code=100, headers=[])
            await self._send_all(self._h11.send(go_on) or b"")
        body = bytearray()
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_body:
                    self._too_large(max_body)
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                return None

    async def _answer(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]], head_only: bool
    ) -> int:
        """A whole response the edge gives itself (a preflight, a 401, a 405); the connection stays
        usable. Returns ``status``."""
        if body:
            length = b"%d" % len(body)
            headers = [*headers, (b"content-type", b"application/json"), (b"content-length", length)]
        conn = self._h11
        out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        if body and not head_only:  # a response to HEAD has no body (h11 refuses one)
            out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await self._send_all(out)
        return status

    def _log(self, status: int, response: Response | None = None, request_id: str | None = None) -> None:
        """The access-log line of the request being served, once, at its end (nothing per token)."""
        request, self._request = self._request, None
        access = self._server.access_log
        if request is None or access is None or not access.wanted(request.target.split(b"?", 1)[0]):
            return
        ttft = prompt_tokens = output_tokens = None
        if response is not None:
            prompt_tokens, output_tokens = response.prompt_tokens, response.completion_tokens
            if response.first_token_time:
                ttft = response.first_token_time - self._started
        access.write(
            AccessRecord(
                client=_address(self._sock.getpeername),
                method=request.method.decode("ascii"),
                target=request.target.decode("latin-1"),
                http_version=request.http_version.decode("ascii"),
                status=status or CLIENT_LEFT,
                duration=time.time() - self._started,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                ttft=ttft,
                request_id=request_id,
            )
        )

    def _too_large(self, max_body: int) -> None:
        self._reply_error(413, f"request body is larger than the limit of {max_body} bytes")

    async def _generate(self, kind: Kind, body: bytes, verdict: Verdict) -> tuple[int, Response | None, str]:
        """Serve a generation request; returns its status (0: the client left before any), its
        response (None if refused) and its request id."""
        serving = self._server.serving
        # Unique across the deployment, with the client's X-Request-Id in front when it sent one: two
        # clients that send the same one still get distinct response ids and engine requests.
        request_id = serving.new_request_id()
        if verdict.request_id is not None:
            request_id = f"{verdict.request_id}-{request_id}"
        headers = verdict.headers
        if self._server.gate.echo_request_id:  # the client's own, or the id the server made
            headers = [*headers, (REQUEST_ID_HEADER, (verdict.request_id or request_id).encode())]
        sink = HttpSink(self._sock, self._h11, headers)
        try:
            response = await serving.start(kind, body, sink, request_id=request_id)
        except ApiError as exc:
            sink.full(exc.status, exc.body(), retry_after=exc.retry_after)
            await sink.flush()
            return exc.status, None, request_id
        # One task per connection: it parks reading the socket (EOF means the client left; pipelined
        # bytes wait for the next cycle) and the sink interrupts that when it needs the task: to
        # drain a backlog, or because the response is complete.
        try:
            while not (response.done and not sink.backlogged) and not sink.closed:
                if sink.backlogged:
                    await sink.flush()
                    sink.drained()
                elif await sink.waker.run_until_set(self._recv) == b"":
                    sink.closed = True
        finally:
            if not response.done:
                serving.cancel(response)
        return sink.status, response, request_id


def _address(get: Callable[[], object]) -> tuple[str, int] | None:
    try:
        address = get()
    except OSError:
        return None
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None  # a Unix socket (tests, socketpairs): no host and port


class AcceptBackoff:
    """When ``accept()`` fails for want of a resource (EMFILE, ENFILE, ...), how long to wait before
    trying again: 10 ms doubling to 1 s while failures continue, back to 10 ms after a success.
    Pure; the accept loop closes idle connections before it waits."""

    FIRST = 0.01
    LIMIT = 1.0

    def __init__(self) -> None:
        self.delay = 0.0
        self.failures = 0  # consecutive

    def failed(self) -> float:
        self.failures += 1
        self.delay = self.FIRST if self.delay == 0 else min(self.LIMIT, self.delay * 2)
        return self.delay

    def succeeded(self) -> None:
        self.delay = 0.0
        self.failures = 0


class HttpServer:
    def __init__(
        self,
        serving: Serving,
        asgi: AsgiHost,
        max_body: int,
        *,
        upgrade: Upgrade | None = None,
        max_connections: int = 0,
        gate: Gate | None = None,
        access_log: AccessLog | None = None,
        accept_balance: AcceptBalance | None = None,
    ) -> None:
        """``gate``: what every request head is checked against (by default: no API key, CORS for
        every origin); ``access_log``: None writes none; ``accept_balance``: when several API servers
        share the listener, least-loaded accept (``accept_balance.py``; None: accept at once)."""
        self.serving = serving
        self.asgi = asgi
        self.upgrade = upgrade
        self.gate = gate or Gate(AccessConfig())
        self.access_log = access_log
        self.max_body = max_body
        self.max_connections = max_connections  # 0: no limit
        self.connections = 0
        self.refused_connections = 0  # closed at once: over --max-connections
        self.accept_errors = 0  # accept() failed for want of a resource (EMFILE, ...)
        self.draining = False
        self._open: set[HttpConnection] = set()
        self._closed = Waker()  # set whenever a connection closes
        self._accepting = trio.CancelScope()
        self._listener: socket.socket | None = None
        self._backoff = AcceptBackoff()
        self.accept_balance = accept_balance
        # With peers, one accept per wake: the next connection goes to whoever is least loaded then.
        self._accept_batch = _ACCEPT_BATCH if accept_balance is None else 1

    def _connections_changed(self) -> None:
        if self.accept_balance is not None:  # peers read it when they decide whether to defer
            self.accept_balance.publish(self.connections)

    def drain(self) -> None:
        """Graceful shutdown, step one: the listener closes (new connections are refused by the
        kernel), idle keep-alive connections close, and a request that still arrives gets 503 with
        ``Connection: close``. Running requests go on (``Serving.drained`` says when they are done)."""
        self.draining = True
        self._accepting.cancel()
        if self.accept_balance is not None:
            self.accept_balance.retire()  # peers must not defer to a server that no longer accepts
        if self._listener is not None:
            trio.lowlevel.notify_closing(self._listener)
            self._listener.close()
        for conn in list(self._open):
            conn.close_if_idle()

    async def http_closed(self) -> None:
        """Returns once every connection still open is a WebSocket (drain waits for the HTTP
        responses it ended to be written out and their connections closed)."""
        while any(not conn.upgraded for conn in self._open):
            await self._closed.wait()

    def close_idle(self, limit: int | None = None) -> int:
        """Close up to ``limit`` idle keep-alive connections (all when None); returns how many."""
        closed = 0
        for conn in list(self._open):
            if limit is not None and closed >= limit:
                break
            closed += conn.close_if_idle()
        return closed

    async def serve(
        self, listener: socket.socket, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept until ``drain``; each connection is a task in this nursery."""
        listener.setblocking(False)
        self._listener = listener
        async with trio.open_nursery() as nursery:
            task_status.started()
            with self._accepting:
                while True:
                    await trio.lowlevel.wait_readable(listener)
                    if self.accept_balance is not None:
                        await self.accept_balance.wait_turn(self.connections)
                    for n in range(self._accept_batch):
                        try:
                            sock, _ = listener.accept()
                        except (BlockingIOError, InterruptedError, ConnectionAbortedError) as exc:
                            balance = self.accept_balance
                            if n == 0 and balance is not None and isinstance(exc, BlockingIOError):
                                balance.lost_races += 1  # a peer took it
                            break
                        except OSError as exc:
                            if exc.errno not in _RESOURCE_ERRNOS:
                                raise
                            await self._out_of_resources(exc)
                            break
                        self._backoff.succeeded()
                        if self.max_connections and self.connections >= self.max_connections:
                            self.refused_connections += 1
                            sock.close()
                            continue
                        # Counted here, not when its task starts: a batch of accepts has no
                        # checkpoint, and the limit must hold within one.
                        self.connections += 1
                        self._connections_changed()
                        nursery.start_soon(partial(self.handle_connection, sock, counted=True))

    async def _out_of_resources(self, exc: OSError) -> None:
        """Out of descriptors (or memory) to accept with: close idle connections to make room, and
        wait a little so the loop does not spin on a listener that stays readable."""
        self.accept_errors += 1
        freed = self.close_idle(_ACCEPT_BATCH)
        delay = self._backoff.failed()
        if self._backoff.failures == 1 or self._backoff.failures % 100 == 0:
            log.warning(
                "accept failed (%s): closed %d idle connections; %d open; retrying in %.2f s",
                exc.strerror,
                freed,
                self.connections,
                delay,
            )
        await trio.sleep(delay)

    async def handle_connection(self, sock: socket.socket, *, counted: bool = False) -> None:
        """Serve one connection until it closes; ``counted``: the accept loop counted it already."""
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = HttpConnection(sock, self)
        if not counted:
            self.connections += 1
            self._connections_changed()
        self._open.add(conn)
        try:
            await conn.run()
        except Exception:
            # A bug must cost one connection, never the server: log it and answer 500 if we still can.
            log.exception("connection handler failed")
            conn.internal_error()
        finally:
            try:
                if not conn.upgraded:
                    await conn.linger()
            finally:
                self._open.discard(conn)
                self.connections -= 1
                self._connections_changed()
                self._closed.set()
                if not conn.upgraded:
                    trio.lowlevel.notify_closing(sock)
                    sock.close()
