"""An abort never overtakes its own request (issue 10 item 8), on a MockClock.

A client that leaves right after sending its request (an HTTP disconnect, a WebSocket cancel) makes the
API server abort a request whose add may still be queued for the engine. The abort must never reach
the engine before its add (the engine would ignore it, then run the add to ``max_tokens``): an add
still queued is dropped instead, and an abort for a sent add goes out after it. Checked at every
point between accept and first token: after ``k`` scheduler checkpoints, or after ``k`` engine steps.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.lowlevel
import zmq
from trio.testing import MockClock
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.test_engine_core import CoreStack, start_core_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.engine.core import RecentAborts
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.protocol.codec import engine_input_codec
from trioserve.protocol.messages import AbortRequests, AddRequest, SamplingParams

STEP = STEP_US / 1e6
LONG = 400  # tokens (max_model_len is 512): an orphan would run for 4 s of engine steps
CHECKPOINTS = range(0, 24)
STEPS = range(0, 4)


@asynccontextmanager
async def mock_stack(tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    with trio.fail_after(120):  # virtual seconds: a hang fails fast
        async with trio.open_nursery() as nursery:
            yield await start_stack(nursery, tokenizer, BASE_CONFIG)
            nursery.cancel_scope.cancel()


def engine_requests(stack: Stack) -> int:
    if isinstance(stack, CoreStack):
        return len(stack.core.scheduler.requests)
    core = stack.engine.core
    return len(core.running) + len(core.waiting)


async def wait(checkpoints: int, steps: int) -> None:
    for _ in range(checkpoints):
        await trio.lowlevel.checkpoint()
    if steps:
        await trio.sleep(steps * STEP)


async def assert_engine_empty_within_one_step(stack: Stack) -> None:
    # The step running when the abort arrives still ends (the engine core applies aborts right after
    # its forward, at the same virtual instant as this test would look): hence the tenth of a step.
    await trio.sleep(STEP + STEP / 10)
    assert engine_requests(stack) == 0, "an aborted request is still in the engine (an orphan)"
    # ... and stays so: nothing arrives late.
    await trio.sleep(5 * STEP)
    assert engine_requests(stack) == 0
    assert stack.api.engine.queued_adds == 0


class WsClient:
    """Just enough of a WebSocket client: the upgrade through the accept loop, then text messages."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)

    @classmethod
    async def connect(cls, stack: Stack) -> WsClient:
        server_end, client_end = socket.socketpair()
        stack.nursery.start_soon(stack.api.http.handle_connection, server_end)
        client = cls(trio.socket.from_stdlib_socket(client_end))
        await client.sock.send(client.ws.send(Request(host="test", target="/v1/ws")))
        while True:
            client.ws.receive_data(await client.sock.recv(65536))
            if any(isinstance(e, AcceptConnection) for e in client.ws.events()):
                return client

    async def send(self, message: dict[str, object]) -> None:
        await self.sock.send(self.ws.send(TextMessage(data=msgspec.json.encode(message).decode())))


async def http_disconnect(stack: Stack, checkpoints: int, steps: int) -> None:
    client = await stack.client()
    await client.send_request(CHAT, chat_body(LONG))
    await wait(checkpoints, steps)
    client.close()
    await assert_engine_empty_within_one_step(stack)
    assert not stack.api.serving.active


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
async def test_http_disconnect_after_checkpoints(
    tokenizer: Tokenizer, autojump_clock: MockClock, checkpoints: int
) -> None:
    async with mock_stack(tokenizer) as stack:
        await http_disconnect(stack, checkpoints, 0)


@pytest.mark.parametrize("steps", STEPS)
async def test_http_disconnect_after_steps(
    tokenizer: Tokenizer, autojump_clock: MockClock, steps: int
) -> None:
    async with mock_stack(tokenizer) as stack:
        await http_disconnect(stack, 0, steps)


@pytest.mark.parametrize("checkpoints", CHECKPOINTS)
async def test_websocket_cancel_after_checkpoints(
    tokenizer: Tokenizer, autojump_clock: MockClock, checkpoints: int
) -> None:
    async with mock_stack(tokenizer) as stack:
        client = await WsClient.connect(stack)
        await client.send(
            {"type": "request", "id": "r", "endpoint": "chat.completions", "body": chat_body(LONG)}
        )
        await wait(checkpoints, 0)
        await client.send({"type": "cancel", "id": "r"})
        await assert_engine_empty_within_one_step(stack)


@pytest.mark.parametrize("checkpoints", range(0, 24, 3))
async def test_http_disconnect_through_the_engine_core(
    tokenizer: Tokenizer, autojump_clock: MockClock, checkpoints: int
) -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            stack = await start_core_stack(nursery, tokenizer, num_blocks=1024)
            await http_disconnect(stack, checkpoints, 0)
            nursery.cancel_scope.cancel()


async def test_a_storm_of_disconnects_leaves_nothing_running(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    """The issue's reproduction: 20 clients with max_tokens 3000 that all close at once."""
    async with mock_stack(tokenizer) as stack:
        clients = [await stack.client() for _ in range(20)]
        for client in clients:
            await client.send_request(CHAT, chat_body(LONG))
        for client in clients:
            client.close()
        await assert_engine_empty_within_one_step(stack)


# ---- the engine client's queue rule, directly ------------------------------------------------------


def add(rid: str) -> AddRequest:
    return AddRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), 0.0)


def sent(client: EngineClient) -> list[tuple[str, str | list[str]]]:
    """Drain what the sender would send, in order, decoded."""
    codec = engine_input_codec()
    out: list[tuple[str, str | list[str]]] = []
    while (item := client.next_frame()) is not None:
        match codec.decode(item[1]):
            case AddRequest(request_id=rid):
                out.append(("add", rid))
            case AbortRequests(request_ids=ids):
                out.append(("abort", ids))
    return out


def test_abort_of_a_queued_add_drops_it_and_an_abort_of_a_sent_one_goes_out() -> None:
    client = EngineClient(
        zmq.Context.instance(),
        handshake_address="inproc://h",
        input_address="inproc://i",
        output_address="inproc://o",
    )
    client.add(add("a"))
    assert sent(client) == [("add", "a")]  # "a" is on its way to the engine
    for rid in "bcd":
        client.add(add(rid))
    client.abort(["c", "a"])
    assert client.queued_adds == 2 and client.dropped_adds == 1
    # "c" never leaves; the abort of "a" (sent already) does, ahead of the other requests' adds.
    assert sent(client) == [("abort", ["a"]), ("add", "b"), ("add", "d")]
    client.abort(["b", "d"])
    assert sent(client) == [("abort", ["b", "d"])]
    assert client.queued_adds == 0


async def test_the_engine_drops_an_add_that_arrives_after_its_abort(
    tokenizer: Tokenizer, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's defensive rule alone: with an API server that (wrongly) sends an abort ahead of
    its queued add, the engine still never runs the add."""

    def abort_first(self: EngineClient, request_ids: list[str]) -> None:  # the old fast path
        self._aborts.setdefault(0, []).extend(request_ids)
        self._wake.set()

    monkeypatch.setattr(EngineClient, "abort", abort_first)
    async with mock_stack(tokenizer) as stack:
        clients = [await stack.client() for _ in range(5)]
        for client in clients:
            await client.send_request(CHAT, chat_body(LONG))
        for client in clients:
            client.close()
        await assert_engine_empty_within_one_step(stack)


def test_recent_aborts_is_bounded() -> None:
    recent = RecentAborts(capacity=3)
    recent.remember(["a", "b", "a"])
    assert recent.overtaken("a") and recent.overtaken("b") and not recent.overtaken("c")
    recent.remember(["c", "d"])  # "a" is forgotten: the oldest of four
    assert not recent.overtaken("a") and recent.overtaken("d")
