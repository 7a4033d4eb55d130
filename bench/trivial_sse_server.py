"""A trivial OpenAI-shaped SSE server on trio: the load generator's baseline.

It answers ``GET /health``, ``GET /v1/models`` and streaming ``POST /v1/chat/completions`` (only
``max_tokens`` is read from the body) with fixed, pre-encoded chunk events. One ticker task runs on a fixed
clock (``--step-interval-us``, like the mock engine) and writes the next event of every active stream
straight to its socket with a non-blocking ``send``; only a connection whose socket buffer is full gets
its bytes queued and flushed by a task of its own. That is about the cheapest streaming server Python
and trio allow, so the load generator's ceiling against it is the ceiling of the measurement.

    python bench/trivial_sse_server.py --port 8000 --step-interval-us 10000
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

import msgspec
import trio

_MODEL = "mock"


def _event(payload: object) -> bytes:
    """One SSE event as one HTTP chunk."""
    sse = b"data: " + msgspec.json.encode(payload) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(sse), sse)


def _chunk(delta: dict[str, str], token_ids: list[int], finish: str | None) -> dict[str, object]:
    return {
        "id": "chatcmpl-0123456789abcdef0123456789abcdef",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": _MODEL,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                "token_ids": token_ids,
            }
        ],
    }


class Events:
    """Pre-encoded events: a role event, token events carrying k tokens, the tail."""

    def __init__(self, tokens_per_event: int) -> None:
        self.k = tokens_per_event
        self.first = _event(_chunk({"role": "assistant", "content": ""}, [], None))
        self.token: list[bytes] = []
        for v in range(16):
            ids = [1000 + 37 * v + j for j in range(tokens_per_event)]
            text = "".join(f" tok{i}" for i in ids)
            self.token.append(_event(_chunk({"content": text}, ids, None)))
        self.tail = _event(_chunk({}, [], "length")) + _event_done() + b"0\r\n\r\n"

    def partial(self, n: int) -> bytes:
        ids = list(range(2000, 2000 + n))
        return _event(_chunk({"content": "".join(f" tok{i}" for i in ids)}, ids, None))


def _event_done() -> bytes:
    sse = b"data: [DONE]\n\n"
    return b"%x\r\n%s\r\n" % (len(sse), sse)


class Conn:
    __slots__ = ("broken", "drained", "flushing", "nursery", "pending", "remaining", "sock", "stream_done")

    def __init__(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        self.sock = sock
        self.nursery = nursery
        self.pending = bytearray()
        self.flushing = False
        self.broken = False
        self.remaining = 0
        self.stream_done = trio.Event()
        self.drained = trio.Event()

    def write(self, data: bytes) -> None:
        """Send now if the socket takes it; otherwise queue it for this connection's flusher."""
        if self.broken:
            return
        if self.pending:
            self.pending += data
            return
        try:
            n = self.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self.broken = True
            return
        if n < len(data):
            self.pending += data[n:]
            if not self.flushing:
                self.flushing = True
                self.drained = trio.Event()
                self.nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        try:
            while self.pending and not self.broken:
                await trio.lowlevel.wait_writable(self.sock)
                try:
                    n = self.sock.send(self.pending)
                except BlockingIOError:
                    continue
                except OSError:
                    self.broken = True
                    break
                del self.pending[:n]
        finally:
            self.flushing = False
            self.drained.set()


class Server:
    def __init__(self, step_interval_s: float, events: Events) -> None:
        self.interval = step_interval_s
        self.events = events
        self.active: dict[Conn, None] = {}  # insertion-ordered set of streaming connections
        self.models = msgspec.json.encode(
            {"object": "list", "data": [{"id": _MODEL, "object": "model", "owned_by": "bench"}]}
        )

    async def ticker(self) -> None:
        ev = self.events
        k = ev.k
        deadline = trio.current_time()
        tick = 0
        while True:
            deadline += self.interval
            deadline = max(deadline, trio.current_time())  # fell behind: delay, do not burst
            await trio.sleep_until(deadline)
            tick += 1
            token_ev = ev.token[tick & 15]
            finished: list[Conn] = []
            for conn in self.active:
                if conn.broken:
                    finished.append(conn)
                    continue
                rem = conn.remaining
                if rem > k:
                    conn.remaining = rem - k
                    conn.write(token_ev)
                else:
                    conn.remaining = 0
                    conn.write((token_ev if rem == k else ev.partial(rem)) + ev.tail)
                    finished.append(conn)
            for conn in finished:
                del self.active[conn]
                conn.stream_done.set()

    async def handle(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        conn = Conn(sock, nursery)
        buf = bytearray()
        try:
            while not conn.broken:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if not await _read_more(sock, buf):
                        return
                    continue
                head = bytes(buf[:end]).split(b"\r\n")
                method, path, _ = head[0].split(b" ", 2)
                length = 0
                for line in head[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < end + 4 + length:
                    if not await _read_more(sock, buf):
                        return
                body = bytes(buf[end + 4 : end + 4 + length])
                del buf[: end + 4 + length]
                await self.route(conn, method, path, body)
        except OSError:
            return
        finally:
            self.active.pop(conn, None)
            sock.close()

    async def route(self, conn: Conn, method: bytes, path: bytes, body: bytes) -> None:
        if method == b"POST" and path == b"/v1/chat/completions":
            max_tokens = int(msgspec.json.decode(body).get("max_tokens") or 16)
            conn.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + self.events.first
            )
            conn.remaining = max_tokens
            conn.stream_done = trio.Event()
            self.active[conn] = None
            await conn.stream_done.wait()
            if conn.flushing:
                await conn.drained.wait()
            return
        if method == b"GET" and path == b"/health":
            payload, ctype = b"ok", b"text/plain"
        elif method == b"GET" and path == b"/v1/models":
            payload, ctype = self.models, b"application/json"
        else:
            conn.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (ctype, len(payload), payload)
        )


async def serve(host: str, port: int, server: Server) -> None:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((host, port))
    lsock.listen(4096)
    lsock.setblocking(False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.ticker)
        while True:
            await trio.lowlevel.wait_readable(lsock)
            while True:
                try:
                    sock, _ = lsock.accept()
                except BlockingIOError:
                    break
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nursery.start_soon(server.handle, sock, nursery)


async def _read_more(sock: socket.socket, buf: bytearray) -> bool:
    """Append what the socket has to ``buf``; False at EOF."""
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            continue
        buf += data
        return bool(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="trivial trio SSE server (load-generator baseline)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--step-interval-us", type=int, default=10000)
    ap.add_argument("--tokens-per-event", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=None, help="pin to this CPU core")
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = Server(args.step_interval_us / 1e6, Events(args.tokens_per_event))
    try:
        trio.run(serve, args.host, args.port, server)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
