"""``/v1/ws`` on the accept loop's fast path (``ws_server.py``), on a MockClock: messages, cancels,
control frames, and the stream policies with a client that stops reading (tiny socket buffers)."""

from __future__ import annotations

import itertools
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
from trio.testing import MockClock
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.test_streaming import chat_body
from trioserve.config import ServeConfig, override
from trioserve.frontend.edge.ws_server import READ_PAUSE_BYTES, WS_PATH, WsConnection, websocket_upgrade
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.protocol.ws_frames import upgrade_response

STEP = STEP_US / 1e6
TOKENS = 200
PAUSE = 60 * STEP  # how long the slow client stops reading


@dataclass
class Msg:
    time: float
    data: dict[str, Any]


@dataclass
class WsClient:
    sock: trio.socket.SocketType
    ws: WSConnection = field(default_factory=lambda: WSConnection(ConnectionType.CLIENT))
    pending: list[Event] = field(default_factory=list)
    messages: list[Msg] = field(default_factory=list)
    _text: str = ""

    async def next_event(self) -> Event:
        while not self.pending:
            data = await self.sock.recv(65536)
            assert data, "the server closed the connection"
            self.ws.receive_data(data)
            self.pending += list(self.ws.events())
        return self.pending.pop(0)

    async def next(self) -> dict[str, Any]:
        """The next complete server message (text frames only)."""
        while True:
            event = await self.next_event()
            assert isinstance(event, TextMessage), event
            self._text += event.data
            if event.message_finished:
                data = msgspec.json.decode(self._text)
                self._text = ""
                self.messages.append(Msg(trio.current_time(), data))
                return data

    async def send(self, message: dict[str, Any]) -> None:
        await self.sock.send(self.ws.send(TextMessage(data=msgspec.json.encode(message).decode())))

    async def request(self, rid: str, body: dict[str, Any], endpoint: str = "chat.completions") -> None:
        await self.send({"type": "request", "id": rid, "endpoint": endpoint, "body": body})

    async def until_final(self, rid: str) -> dict[str, Any]:
        while True:
            msg = await self.next()
            if msg["id"] == rid and msg["type"] != "chunk":
                return msg

    def chunks(self, rid: str) -> list[Msg]:
        return [m for m in self.messages if m.data["id"] == rid and m.data["type"] == "chunk"]


@asynccontextmanager
async def running_stack(tokenizer: Tokenizer, config: ServeConfig = BASE_CONFIG) -> AsyncIterator[Stack]:
    with trio.fail_after(60):  # virtual seconds: a hang fails fast
        async with trio.open_nursery() as nursery:
            yield await start_stack(nursery, tokenizer, config)
            nursery.cancel_scope.cancel()


async def ws_client(stack: Stack, rcvbuf: int | None = None, *, via_accept_loop: bool = False) -> WsClient:
    """A client socket served by the fast path: through the accept loop's connection handler (the
    wiring), or by ``websocket_upgrade`` directly."""
    server_end, client_end = socket.socketpair()
    if rcvbuf is not None:
        for s in (server_end, client_end):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    client = WsClient(trio.socket.from_stdlib_socket(client_end))
    if via_accept_loop:
        stack.nursery.start_soon(stack.api.http.handle_connection, server_end)
        await client.sock.send(client.ws.send(Request(host="test", target="/v1/ws")))
    else:
        server_end.setblocking(False)
        session = websocket_upgrade(stack.api.serving, stack.api.frontend.http.max_request_body_bytes)(
            server_end, client.ws.send(Request(host="test", target="/v1/ws"))
        )
        assert session is not None
        stack.nursery.start_soon(session)
    event = await client.next_event()
    assert isinstance(event, AcceptConnection), event
    return client


def content(msgs: list[Msg]) -> list[Msg]:
    return [m for m in msgs if m.data["data"].get("choices") and "token_ids" in m.data["data"]["choices"][0]]


def tokens_per_chunk(msgs: list[Msg]) -> list[int]:
    return [len(m.data["data"]["choices"][0]["token_ids"]) for m in content(msgs)]


def gaps(msgs: list[Msg]) -> list[float]:
    times = [m.time for m in content(msgs)]
    return [b - a for a, b in itertools.pairwise(times)]


async def test_requests_cancel_ping_and_bad_messages(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with running_stack(tokenizer) as stack:
        c = await ws_client(stack, via_accept_loop=True)
        await c.request("a", chat_body(5))
        await c.request("b", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, endpoint="completions")
        await c.request("long", chat_body(400))
        finals: dict[str | None, list[str]] = {}

        async def until(done: Callable[[], bool]) -> None:
            while not done():
                msg = await c.next()
                if msg["type"] != "chunk":
                    finals.setdefault(msg["id"], []).append(msg["type"])

        await until(lambda: {"a", "b"} <= finals.keys() and len(c.chunks("long")) >= 3)
        await c.send({"type": "cancel", "id": "long"})
        await c.send({"type": "cancel", "id": "a"})  # finished: ignored
        await until(lambda: "long" in finals)
        await c.sock.send(c.ws.send(Ping(payload=b"hey")))
        event = await c.next_event()
        assert isinstance(event, Pong) and event.payload == b"hey"
        await c.sock.send(c.ws.send(TextMessage(data="not json")))
        await c.request("a", chat_body(2))  # the id is free again
        await c.request("d", chat_body(20))
        await c.request("d", chat_body(20))  # still running: refused
        await until(lambda: None in finals and len(finals["a"]) == 2 and len(finals.get("d", [])) == 2)
        await c.sock.send(c.ws.send(CloseConnection(code=1000)))
        event = await c.next_event()
        assert isinstance(event, CloseConnection) and event.code == 1000
        await trio.sleep(STEP)
        assert stack.api.serving.active == set()
    assert finals == {
        "a": ["done", "done"],
        "b": ["response"],
        "long": ["done"],
        None: ["error"],
        "d": ["error", "done"],
    }
    a_chunks = [m.data["data"] for m in c.chunks("a")]
    assert a_chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum(tokens_per_chunk(c.chunks("a"))) == 5 + 2
    assert sum(tokens_per_chunk(c.chunks("d"))) == 20
    assert 3 <= sum(tokens_per_chunk(c.chunks("long"))) < 400


async def test_fragmented_and_oversized_messages(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with running_stack(tokenizer, override(BASE_CONFIG, max_request_body_bytes=1000)) as stack:
        c = await ws_client(stack)
        big = "x" * 40_000  # the limit is the body limit + 64 KiB: 66536 characters
        for i in range(3):
            await c.sock.send(c.ws.send(TextMessage(data=big, message_finished=i == 2)))
        refused = await c.next()
        assert refused["id"] is None and refused["status"] == 413
        request = msgspec.json.encode({"type": "request", "id": "ok", "body": chat_body(3)}).decode()
        half = len(request) // 2
        await c.sock.send(c.ws.send(TextMessage(data=request[:half], message_finished=False)))
        await c.sock.send(c.ws.send(TextMessage(data=request[half:])))
        assert (await c.until_final("ok"))["type"] == "done"
    assert sum(tokens_per_chunk(c.chunks("ok"))) == 3


async def test_client_leaving_cancels_its_requests(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with running_stack(tokenizer) as stack:
        c = await ws_client(stack)
        await c.request("x", chat_body(400))
        await c.request("y", chat_body(400))
        while not (c.chunks("x") and c.chunks("y")):
            await c.next()
        c.sock.close()
        await trio.sleep(3 * STEP)
        assert stack.api.serving.active == set()
        assert not stack.engine.core.running


async def slow_and_fast(tokenizer: Tokenizer, policy: str, **config: Any) -> tuple[WsClient, WsClient, int]:
    """A slow socket (two requests) and a fast one side by side; returns both clients and how many
    requests the engine still runs right after the slow client resumed reading."""
    cfg: ServeConfig = override(BASE_CONFIG, stream_policy=policy, **config)
    async with running_stack(tokenizer, cfg) as stack:
        slow, fast = await ws_client(stack, rcvbuf=4096), await ws_client(stack)
        await slow.request("s1", chat_body(TOKENS))
        await slow.request("s2", chat_body(TOKENS))
        await fast.request("f", chat_body(TOKENS))
        while len(slow.messages) < 3:
            await slow.next()
        fast_done = trio.Event()

        async def read_fast() -> None:
            await fast.until_final("f")
            fast_done.set()

        stack.nursery.start_soon(read_fast)
        await trio.sleep(PAUSE)
        running = len(stack.engine.core.running)
        finals: set[str] = set()
        while finals != {"s1", "s2"}:
            msg = await slow.next()
            if msg["type"] != "chunk":
                finals.add(msg["id"])
        await fast_done.wait()
    return slow, fast, running


async def test_merge_slow_socket_gets_merged_chunks_fast_one_is_untouched(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    slow, fast, running = await slow_and_fast(tokenizer, "merge")
    assert running == 3  # nobody was aborted, and the engine never waited
    for rid in ("s1", "s2"):
        assert sum(tokens_per_chunk(slow.chunks(rid))) == TOKENS
        assert max(tokens_per_chunk(slow.chunks(rid))) > 1
    assert tokens_per_chunk(fast.chunks("f")) == [1] * TOKENS
    assert max(gaps(fast.chunks("f"))) < 1.5 * STEP  # the output handler never waited on the slow one


async def test_queue_n_queues_chunks_before_merging(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    slow, _, _ = await slow_and_fast(tokenizer, f"queue:{TOKENS}")
    assert tokens_per_chunk(slow.chunks("s1")) == [1] * TOKENS
    slow8, _, _ = await slow_and_fast(tokenizer, "queue:8")
    assert sum(tokens_per_chunk(slow8.chunks("s1"))) == TOKENS
    assert max(tokens_per_chunk(slow8.chunks("s1"))) > 1


async def test_abort_slow_client_cuts_off_only_the_slow_socket(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    slow, fast, running = await slow_and_fast(tokenizer, "abort-slow-client", slow_client_max_tokens=16)
    assert running == 1  # both of the slow socket's requests were aborted while it did not read
    for rid in ("s1", "s2"):
        msgs = [m.data for m in slow.messages if m.data["id"] == rid]
        assert msgs[-1]["type"] == "done"
        error = msgs[-2]["data"]["error"]
        assert error["code"] == 503 and "too slow" in error["message"]
        assert sum(tokens_per_chunk(slow.chunks(rid))) < TOKENS
    assert tokens_per_chunk(fast.chunks("f")) == [1] * TOKENS
    assert max(gaps(fast.chunks("f"))) < 1.5 * STEP


async def test_stall_makes_every_stream_wait_for_the_slowest(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    slow, fast, _ = await slow_and_fast(tokenizer, "stall")
    assert sum(tokens_per_chunk(slow.chunks("s1"))) == TOKENS
    assert sum(tokens_per_chunk(fast.chunks("f"))) == TOKENS
    assert max(gaps(fast.chunks("f"))) > PAUSE / 2  # the fast socket waited while the slow one did not read


async def test_a_client_that_sends_and_never_reads_meets_backpressure(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    """Every invalid message gets an error reply; a client that never reads them must not make the
    server buffer replies without bound: past READ_PAUSE_BYTES the server stops reading it."""
    async with running_stack(tokenizer) as stack:
        server_end, client_end = socket.socketpair()
        for end in (server_end, client_end):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        server_end.setblocking(False)
        client = WsClient(trio.socket.from_stdlib_socket(client_end))
        upgrade = upgrade_response(client.ws.send(Request(host="test", target="/v1/ws")), WS_PATH)
        assert upgrade is not None
        conn = WsConnection(server_end, stack.api.serving, stack.api.frontend.http.max_request_body_bytes)
        stack.nursery.start_soon(conn.run, *upgrade)
        assert isinstance(await client.next_event(), AcceptConnection)
        frame = client.ws.send(TextMessage(data="x"))  # not JSON: an error reply each
        sent = 0
        with trio.move_on_after(20):
            for _ in range(200_000):
                await client.sock.send(frame)
                sent += 1
        assert sent < 200_000, "the server read everything: nothing held the client back"
        assert conn.backlog_bytes < READ_PAUSE_BYTES + 65536
        # It still serves the client once the client reads again (the request queues behind the
        # invalid messages still unread, so it is sent while the replies are read).
        with trio.fail_after(25):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.request, "r", chat_body(3))
                assert (await client.until_final("r"))["type"] == "done"
        assert sum(1 for m in client.messages if m.data["type"] == "error") == sent
