"""Admission control end to end on a MockClock: refused at once, first N unaffected, slots released."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import h11
import pytest
import trio
import trio.lowlevel
import trio.testing
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.edge.http_sink import HttpSink
from trioserve.frontend.text.tokenizer import Tokenizer

STEP = STEP_US / 1e6


@pytest.fixture
async def limited(tokenizer: Tokenizer, autojump_clock: MockClock) -> AsyncIterator[Stack]:
    config = override(BASE_CONFIG, max_concurrent_requests=2, max_loop_lag_ms=500.0)
    async with trio.open_nursery() as nursery:
        yield await start_stack(nursery, tokenizer, config)
        nursery.cancel_scope.cancel()


async def test_request_over_the_limit_gets_429_at_once(limited: Stack, autojump_clock: MockClock) -> None:
    admission = limited.api.serving.admission
    first, second = await limited.client(), await limited.client()
    for client in (first, second):
        await client.send_request(CHAT, chat_body(50))
    heads = [await c.read_head() for c in (first, second)]
    started = [await c.read_body(h, max_events=2) for c, h in zip((first, second), heads, strict=True)]
    sent_at = trio.current_time()
    third = await (await limited.client()).request(CHAT, chat_body(5))
    assert third.status == 429
    assert third.headers[b"retry-after"] == b"1"
    assert third.json()["error"]["type"] == "RateLimitError"
    assert trio.current_time() == sent_at  # refused without waiting for anything
    # The first two are untouched: every token still one step apart, all of them delivered.
    for client, reply in zip((first, second), started, strict=True):
        await client.read_body(reply)
        tokens = reply.content_events()
        assert len(tokens) == 50
    assert admission.in_flight == 0
    assert (await (await limited.client()).request(CHAT, chat_body(3))).status == 200


async def test_slot_is_released_on_every_exit_path(limited: Stack, autojump_clock: MockClock) -> None:
    serving = limited.api.serving
    admission = serving.admission
    client = await limited.client()
    # A validation error after the slot was taken.
    assert (await client.request(CHAT, chat_body(10_000))).status == 400
    assert admission.in_flight == 0
    # A stop string ends it early (the engine request is aborted).
    assert (await client.request(CHAT, chat_body(20, stop=[" "]))).status == 200
    assert admission.in_flight == 0
    # The engine refuses it.
    limited.engine.core.max_model_len = 8
    assert (await client.request(CHAT, chat_body(5))).status == 400
    assert admission.in_flight == 0
    limited.engine.core.max_model_len = BASE_CONFIG.model.max_model_len
    # The client disconnects mid-stream.
    leaving = await limited.client()
    await leaving.send_request(CHAT, chat_body(100))
    await leaving.read_body(await leaving.read_head(), max_events=3)
    assert admission.in_flight == 1
    leaving.close()
    await trio.sleep(2 * STEP)
    assert admission.in_flight == 0
    # The request is cancelled while it renders (server shutdown, a dropped WebSocket).
    with trio.CancelScope() as scope:
        scope.cancel()
        sink = HttpSink(socket.socketpair()[0], h11.Connection(h11.SERVER))
        await serving.start("chat", b'{"messages":[{"role":"user","content":"hi"}]}', sink)
    assert admission.in_flight == 0
    assert not serving.active


async def test_loop_lag_sheds_new_requests_with_503(limited: Stack, autojump_clock: MockClock) -> None:
    client = await limited.client()
    assert (await client.request(CHAT, chat_body(2))).status == 200
    autojump_clock.jump(0.8)  # the loop "stalls": the lag monitor wakes 0.75 s late
    await trio.testing.wait_all_tasks_blocked()
    assert limited.api.serving.admission.loop_lag > 0.5
    shed = await client.request(CHAT, chat_body(2))
    assert shed.status == 503 and shed.headers[b"retry-after"] == b"1"
    assert "behind" in shed.json()["error"]["message"]
    await trio.sleep(0.2)  # the monitor sees an on-time loop again
    assert (await client.request(CHAT, chat_body(2))).status == 200
    assert limited.api.serving.admission.rejected == {"loop_lag": 1}
