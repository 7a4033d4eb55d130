"""Out of file descriptors and ``--max-connections``: a real server under a lowered ``RLIMIT_NOFILE``.

The server runs with both its soft and hard limit at ``FD_LIMIT`` (so raising the soft limit to the
hard one at start-up, which it does, cannot lift it), and gets more idle connections than it has
descriptors for, beside streams that must finish.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from ._own_server import Server
from ._support import RawHttp, chat_body, post, request_json, sse_chunks

FD_LIMIT = 256


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[Server]:
    server = Server(tmp_path / "limited.log", fd_limit=FD_LIMIT)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def _metric(port: int, name: str) -> float:
    async with await RawHttp.connect("127.0.0.1", port) as conn:
        await conn.send(b"GET /metrics HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        text = (await conn.read_response()).body.decode()
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def _stream(port: int, max_tokens: int) -> list[dict[str, object]]:
    async with await RawHttp.connect("127.0.0.1", port) as conn:
        await conn.send(post("/v1/chat/completions", chat_body(max_tokens, stream=True, ignore_eos=True)))
        response = await conn.read_response()
    assert response.status == 200, response.body[:200]
    return sse_chunks(response.body)


@pytest.mark.multiproc
async def test_more_idle_connections_than_descriptors_never_kill_the_server(limited: Server) -> None:
    idle: list[trio.SocketStream] = []
    streams: list[list[dict[str, object]]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FD_LIMIT + 100
    assert soft > wanted + 100, "the test process itself needs the descriptors"
    async with trio.open_nursery() as nursery:

        async def stream() -> None:
            streams.append(await _stream(limited.port, 300))  # 3 s of tokens

        for _ in range(20):
            nursery.start_soon(stream)
        await trio.sleep(0.5)
        for _ in range(wanted):
            idle.append(await trio.open_tcp_stream("127.0.0.1", limited.port))
        await trio.sleep(1.0)
        assert limited.proc.poll() is None, limited.log()
    # Every stream finished properly.
    assert len(streams) == 20
    for chunks in streams:
        assert chunks[-1] == "[DONE]" or chunks[-1].get("choices") is not None, chunks[-1]
        assert not any(isinstance(c, dict) and "error" in c for c in chunks)
    # The server is still up and answering; it backed off and closed idle connections to do so.
    status, _ = await request_json("127.0.0.1", limited.port, "GET", "/health")
    assert status == 200
    assert await _metric(limited.port, "trioserve:accept_errors_total") > 0
    assert "accept failed" in limited.log()
    for sock in idle:
        await sock.aclose()


@pytest.mark.multiproc
async def test_max_connections_closes_the_excess_at_once(tmp_path: Path) -> None:
    server = Server(tmp_path / "maxconn.log", "--max-connections", "10")
    try:
        server.wait_ready()
        # 30 connects in a burst: the server accepts them in one batch or a few, and the limit holds
        # within a batch. The 20 over it are closed at accept; the 10 it keeps close once their head
        # timeout passes (they never send a request). Only then can /metrics be asked.
        socks = []
        for _ in range(30):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", server.port))
            socks.append(sock)
        open_socks = set(socks)
        with trio.fail_after(30):
            while open_socks:
                await trio.sleep(0.1)
                for sock in list(open_socks):
                    try:
                        data = sock.recv(1)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:
                        data = b""
                    assert data == b"", "the server sent bytes to a connection that sent none"
                    open_socks.discard(sock)
        for sock in socks:
            sock.close()
        # At least the 20 over the limit (a little more when a /health connection of wait_ready was
        # still closing on the server's side as the burst came); without the limit holding within
        # an accept batch, none.
        assert await _metric(server.port, "trioserve:connections_refused_total") >= 20
    finally:
        server.stop()
