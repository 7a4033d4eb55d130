"""The accept loop owns every connection (``http_server.py``): one set of limits for every route,
generation on the fast path whatever came before it, and drain. On a MockClock."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, Stack, start_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.edge.http_server import BODY_TIMEOUT, HEAD_TIMEOUT, MAX_HEAD, MAX_TARGET
from trioserve.frontend.text.tokenizer import Tokenizer

FAST_PATH_MARKER = (b"x-accel-buffering", b"no")  # only the fast path's SSE head carries it


@pytest.fixture
async def long_stack(tokenizer: Tokenizer, autojump_clock: MockClock) -> AsyncIterator[Stack]:
    config = override(BASE_CONFIG, max_model_len=16384)
    async with trio.open_nursery() as nursery:
        yield await start_stack(nursery, tokenizer, config)
        nursery.cancel_scope.cancel()


async def _raw(stack: Stack) -> trio.socket.SocketType:
    """A client socket without an h11 client, for bytes no well-behaved client sends."""
    server_end, client_end = socket.socketpair()
    stack.nursery.start_soon(stack.api.http.handle_connection, server_end)
    await trio.lowlevel.checkpoint()
    return trio.socket.from_stdlib_socket(client_end)


async def _read_all(sock: trio.socket.SocketType) -> bytes:
    data = b""
    while chunk := await sock.recv(65536):
        data += chunk
    return data


# ---- generation stays on the fast path, with no response timeout ------------------------------------


async def test_a_stream_after_another_route_runs_past_60_s_on_the_fast_path(
    long_stack: Stack, autojump_clock: MockClock
) -> None:
    """An SDK-style pooled connection: list the models, then stream 70 s on the same connection.
    It used to be handed to hypercorn for good and cut at quart's 60 s response timeout."""
    client = await long_stack.client()
    models = await client.request("/v1/models", b"", method="GET")
    assert models.status == 200
    start = trio.current_time()
    await client.send_request(CHAT, chat_body(7000))
    reply = await client.read_head()
    assert FAST_PATH_MARKER in reply.headers.items()
    await client.read_body(reply)
    assert trio.current_time() - start > 65  # 7,000 steps of 10 ms
    assert reply.events[-1].data == "[DONE]"
    assert sum(len(c["choices"][0]["token_ids"]) for c in reply.content_events()) == 7000
    client.conn.start_next_cycle()
    assert (await client.request("/v1/models", b"", method="GET")).status == 200  # still reusable


async def test_every_generation_request_on_a_connection_takes_the_fast_path(stack: Stack) -> None:
    client = await stack.client()
    for path in ("/v1/models", "/health", "/metrics"):
        assert (await client.request(path, b"", method="GET")).status == 200
        await client.send_request(CHAT, chat_body(3))
        reply = await client.read_head()
        assert FAST_PATH_MARKER in reply.headers.items(), path
        await client.read_body(reply)
        client.conn.start_next_cycle()


# ---- one set of limits for every route -----------------------------------------------------------------


async def test_idle_keep_alive_after_an_asgi_route_is_closed(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    assert (await client.request("/v1/models", b"", method="GET")).status == 200
    await trio.sleep(HEAD_TIMEOUT + 1)
    assert await client.sock.recv(1) == b""


async def test_connection_close_is_honoured_on_an_asgi_route(stack: Stack) -> None:
    sock = await _raw(stack)
    await sock.send(b"GET /health HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    data = await _read_all(sock)  # returns: the server closed the connection after the response
    assert data.startswith(b"HTTP/1.1 200 ")


async def test_a_trickling_body_on_an_asgi_route_times_out(stack: Stack, autojump_clock: MockClock) -> None:
    sock = await _raw(stack)
    await sock.send(b"POST /tokenize HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n")
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def trickle() -> None:
            for _ in range(999):
                await trio.sleep(1)
                try:
                    await sock.send(b" ")
                except OSError:
                    return

        nursery.start_soon(trickle)
        data = await _read_all(sock)
        nursery.cancel_scope.cancel()
    assert data.startswith(b"HTTP/1.1 408 ")
    assert BODY_TIMEOUT <= trio.current_time() - start < BODY_TIMEOUT + 2


async def test_a_slow_head_gets_408_and_is_closed(stack: Stack, autojump_clock: MockClock) -> None:
    sock = await _raw(stack)
    await sock.send(b"GET /v1/models HTTP/1.1\r\nhost: t\r\n")  # never finished
    data = await _read_all(sock)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert trio.current_time() >= HEAD_TIMEOUT


async def test_after_a_413_the_connection_is_closed_not_left_hanging(stack: Stack) -> None:
    sock = await _raw(stack)
    limit = stack.api.frontend.http.max_request_body_bytes
    await sock.send(b"POST /tokenize HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % (limit + 1))
    data = await _read_all(sock)
    assert data.startswith(b"HTTP/1.1 413 ")
    assert b"connection: close" in data.lower()


@pytest.mark.parametrize("path", ["/v1/models", CHAT])
async def test_a_long_target_is_414(stack: Stack, path: str) -> None:
    sock = await _raw(stack)
    await sock.send(b"GET %s?%s HTTP/1.1\r\nhost: t\r\n\r\n" % (path.encode(), b"q" * MAX_TARGET))
    assert (await _read_all(sock)).startswith(b"HTTP/1.1 414 ")


@pytest.mark.parametrize("path", ["/v1/models", CHAT])
async def test_a_large_header_that_arrives_whole_is_431(stack: Stack, path: str) -> None:
    sock = await _raw(stack)
    big = b"x-big: " + b"a" * (MAX_HEAD + 1) + b"\r\n"
    await sock.send(b"GET %s HTTP/1.1\r\nhost: t\r\n%b\r\n" % (path.encode(), big))
    assert (await _read_all(sock)).startswith(b"HTTP/1.1 431 ")


async def test_plain_get_of_the_websocket_route_is_426(stack: Stack) -> None:
    client = await stack.client()
    reply = await client.request("/v1/ws", b"", method="GET")
    assert reply.status == 426


# ---- drain -------------------------------------------------------------------------------------------


async def test_drain_closes_idle_connections_refuses_new_requests_and_ends_long_streams(
    long_stack: Stack, autojump_clock: MockClock
) -> None:
    stack = long_stack
    api = stack.api
    idle = await stack.client()
    assert (await idle.request("/v1/models", b"", method="GET")).status == 200
    streaming = await stack.client()
    await streaming.send_request(CHAT, chat_body(10_000))
    reply = await streaming.read_body(await streaming.read_head(), max_events=3)
    short = await stack.client()
    await short.send_request(CHAT, chat_body(50))  # finishes within the drain's timeout
    mid_head = await _raw(stack)
    await mid_head.send(b"GET /health HTTP/1.1\r\n")  # a request that is still arriving

    drained = trio.Event()

    async def drain() -> None:
        await api.drain(timeout=10)
        drained.set()

    stack.nursery.start_soon(drain)
    await trio.sleep(0.1)
    assert api.serving.draining
    assert await idle.sock.recv(1) == b""  # idle keep-alive: closed at once
    await mid_head.send(b"host: t\r\n\r\n")
    late = await _read_all(mid_head)
    assert late.startswith(b"HTTP/1.1 503 ") and b"connection: close" in late.lower()
    # The short stream finishes normally.
    short_reply = await short.read_body(await short.read_head())
    assert short_reply.events[-1].data == "[DONE]"
    assert not any("error" in c for c in short_reply.chunks)
    # The long one runs until the deadline, then ends with an error event and a proper end.
    await streaming.read_body(reply)  # returns on h11's EndOfMessage: the chunked body is terminated
    with trio.fail_after(5):
        await drained.wait()
    errors = [c for c in reply.chunks if "error" in c]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 503, errors
    assert "shutting down" in errors[0]["error"]["message"]
    assert reply.events[-1].data == "[DONE]"
    assert trio.current_time() >= 10
    assert not api.serving.active


async def test_health_is_503_while_draining(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    assert (await client.request("/health", b"", method="GET")).status == 200
    stack.api.serving.draining = True  # drain's first step, without closing this connection
    reply = await client.request("/health", b"", method="GET")
    assert reply.status == 503
    assert "shutting down" in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/health"])
async def test_head_gets_the_head_without_the_body(stack: Stack, path: str) -> None:
    client = await stack.client()
    await client.send_request(path, b"", method="HEAD")
    reply = await client.read_head()
    assert reply.status == 200
    await client.read_body(reply)  # h11 (client side) knows HEAD responses have no body
    assert reply.body == b""
    client.conn.start_next_cycle()
    assert (await client.request("/health", b"", method="GET")).status == 200  # the connection goes on


async def test_head_of_a_generation_route_is_405_without_a_body(stack: Stack) -> None:
    client = await stack.client()
    await client.send_request(CHAT, b"", method="HEAD")
    reply = await client.read_body(await client.read_head())
    assert reply.status == 405 and reply.headers[b"allow"] == b"POST" and reply.body == b""
    client.conn.start_next_cycle()
    assert (await client.request("/health", b"", method="GET")).status == 200


async def test_drain_waits_for_a_request_still_rendering_and_refuses_it(
    stack: Stack, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that is rendering when drain begins is in flight too: drain waits for it, and it
    is refused with 503 when its rendering ends (it would otherwise reach the engine after drain)."""
    serving = stack.api.serving
    rendered = trio.Event()
    real_render = serving.render

    async def slow_render(fn: object, *args: object) -> object:
        await rendered.wait()
        return await real_render(fn, *args)

    monkeypatch.setattr(serving, "render", slow_render)
    client = await stack.client()
    await client.send_request(CHAT, chat_body(3))
    await trio.sleep(0.1)
    assert serving.admission.in_flight == 1 and not serving.active
    done = trio.Event()

    async def drain() -> None:
        await stack.api.drain(timeout=30)
        done.set()

    stack.nursery.start_soon(drain)
    await trio.sleep(5)
    assert not done.is_set()  # the rendering request holds it
    rendered.set()
    reply = await client.read_body(await client.read_head())
    assert reply.status == 503 and "shutting down" in reply.json()["error"]["message"]
    with trio.fail_after(1):
        await done.wait()
    assert serving.admission.in_flight == 0 and not serving.active
