"""Hosts the quart-trio app on hypercorn's trio connection handler, fed by our accept loop.

hypercorn's ``TCPServer`` serves any trio stream that has a ``socket``; ``PrefixedStream`` replays the
bytes the fast path already read (the request head, maybe part of the body) before reading the socket,
so hypercorn parses the request from its first byte. The app's lifespan runs here too, once.
"""

from __future__ import annotations

import socket
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState


class PrefixedStream(trio.abc.HalfCloseableStream):
    """A socket stream whose first reads return ``prefix``. No ``do_handshake``: hypercorn treats
    it as plain TCP (it probes for TLS with that attribute)."""

    def __init__(self, stream: trio.SocketStream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix
        self.socket = stream.socket

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            await trio.lowlevel.checkpoint()
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


class AsgiHost:
    def __init__(self, app: Any, *, max_body: int, keep_alive_timeout: float = 5.0) -> None:
        config = Config()
        config.keep_alive_timeout = keep_alive_timeout
        config.h11_max_incomplete_size = 64 * 1024
        config.wsgi_max_body_size = max_body
        config.accesslog = None
        config.include_server_header = False
        self._config = config
        self._app = ASGIWrapper(app)
        self._state: dict[str, Any] = {}
        self._context = WorkerContext(None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the app's lifespan: startup before ``started``, shutdown when cancelled."""
        lifespan = Lifespan(self._app, self._config, self._state)
        async with trio.open_nursery() as nursery:
            await nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await self._context.terminated.set()
                    await lifespan.wait_for_shutdown()
                nursery.cancel_scope.cancel()

    async def handoff(self, sock: socket.socket, prefix: bytes) -> None:
        """Serve this connection with hypercorn until it closes; ``prefix`` was already read."""
        stream = PrefixedStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), prefix)
        state = ConnectionState(self._state.copy())
        # TCPServer is typed for an SSLStream but serves any stream (it probes for TLS).
        server = TCPServer(self._app, self._config, self._context, state, stream)  # type: ignore[arg-type]
        await server.run()
