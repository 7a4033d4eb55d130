"""A Trio-awaitable wrapper around one pyzmq socket.

pyzmq has no Trio integration, so this follows the rules libzmq sets for foreign event loops:

- ``zmq.FD`` is *edge*-triggered and shared by both directions: it signals that ``zmq.EVENTS`` may have
  changed, not that a message is waiting. So every wait first re-reads ``zmq.EVENTS`` and only parks on
  the FD when the wanted bit is clear, and every receive drains with non-blocking calls before waiting.
- Exactly one task owns a socket (Trio also refuses two waiters on one FD with ``BusyResourceError``).
  Other tasks talk to the owner through memory channels.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import trio
import zmq

from trioserve.transport.security import secure

# Monitor endpoints named by a process-wide count. pyzmq's default name is the socket's fd, and a
# closed socket's monitor endpoint is unbound by libzmq's reaper thread some time after the close: a
# new socket that got the same fd number meanwhile failed to bind its monitor ("Address already in
# use", seen once in the test suite's in-process engines).
_MONITORS = itertools.count()


class TrioZmqSocket:
    __slots__ = ("_fd", "_sock", "closed")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))
        self.closed = False

    @classmethod
    def create(
        cls,
        ctx: zmq.Context[zmq.Socket[bytes]],
        kind: int,
        *,
        bind: str | None = None,
        connect: str | None = None,
        identity: bytes | None = None,
        sndhwm: int = 1000,
        rcvhwm: int = 1000,
    ) -> TrioZmqSocket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        try:
            # tcp:// (another host): CURVE from the engine secret, or refused (transport/security.py).
            if bind is not None:
                secure(sock, bind, bind=True)
                sock.bind(bind)
            if connect is not None:
                secure(sock, connect, bind=False)
                sock.connect(connect)
        except BaseException:
            sock.close(linger=0)
            raise
        return cls(sock)

    def monitor(self, events: int) -> TrioZmqSocket:
        """A PAIR socket that receives this socket's ``events`` (``zmq_socket_monitor``), on an
        endpoint no other monitor in this process has used."""
        name = f"inproc://trioserve-monitor-{next(_MONITORS)}"
        return TrioZmqSocket(self._sock.get_monitor_socket(events, addr=name))

    @property
    def raw(self) -> zmq.Socket[bytes]:
        return self._sock

    async def _wait(self, flag: int) -> None:
        while not int(self._sock.getsockopt(zmq.EVENTS)) & flag:
            await trio.lowlevel.wait_readable(self._fd)

    async def wait_readable(self) -> None:
        """Returns once a message can be received."""
        await self._wait(zmq.POLLIN)

    def try_recv_multipart(self) -> list[bytes] | None:
        """One message if one is queued, else None; never blocks."""
        try:
            return self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def recv_multipart(self) -> list[bytes]:
        while True:
            frames = self.try_recv_multipart()
            if frames is not None:
                await trio.lowlevel.checkpoint_if_cancelled()
                return frames
            await self._wait(zmq.POLLIN)

    async def wait_writable(self) -> None:
        """Until a send would not hit the high-water mark."""
        await self._wait(zmq.POLLOUT)

    def try_send_multipart(self, frames: Sequence[bytes | memoryview]) -> bool:
        """Queue one message if the high-water mark allows; False when the socket is full."""
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def send_multipart(self, frames: Sequence[bytes | memoryview]) -> None:
        """Send one message, waiting while the peer's high-water mark is reached."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.try_send_multipart(frames):
            await self._wait(zmq.POLLOUT)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=0)


async def wait_any_readable(*socks: TrioZmqSocket) -> None:
    """Returns once one of ``socks`` has a message (the caller owns them all: one waiter each)."""
    async with trio.open_nursery() as nursery:

        async def first(sock: TrioZmqSocket) -> None:
            await sock.wait_readable()
            nursery.cancel_scope.cancel()

        for sock in socks:
            nursery.start_soon(first, sock)


HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)  # monitor events of a peer whose CURVE handshake failed (a wrong engine secret)
