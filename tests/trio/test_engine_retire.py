"""Retirement (engine/core.py, frontend/replica_roster.py): an engine told ``ClientDone`` by every
client finishes what it holds, then says ``EngineRetired`` and returns; the engine client's side of
a resize (draining ranks get no new request, ``ClientDone`` only after the adds already placed
there, stale rosters ignored, a retired rank no longer shown)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import zmq
from trio.testing import MockClock

from tests.trio.test_engine_core import CoreStack, start_core_stack
from tests.trio.test_replica_client import _add, _client, _join, _ready
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.protocol.codec import engine_input_codec
from trioserve.protocol.messages import ClientDone, ClientReset, EngineInput, EngineRetired


@pytest.fixture
async def core_stack(tokenizer: Tokenizer, autojump_clock: MockClock) -> AsyncIterator[CoreStack]:
    async with trio.open_nursery() as nursery:
        yield await start_core_stack(nursery, tokenizer, num_blocks=512)
        nursery.cancel_scope.cancel()


async def test_an_engine_retires_once_every_client_is_done_and_its_requests_finished(
    core_stack: CoreStack, autojump_clock: MockClock
) -> None:
    client = await core_stack.client()
    await client.send_request(CHAT, chat_body(30))
    head = await client.read_head()
    assert head.status == 200
    engine, link = core_stack.engine, core_stack.api.engine
    engine._on_input(ClientDone(0))  # its only client: it retires, but not before the stream ends
    reply = await client.read_body(head)
    assert sum(len(c["choices"][0]["token_ids"]) for c in reply.content_events()) == 30
    assert [c["choices"][0].get("finish_reason") for c in reply.chunks if c["choices"]][-1] == "length"
    with trio.fail_after(1):
        while 0 not in link.retired:
            await link.link_changed()
    assert link.engines == {} and link.up_engines() == []


async def test_a_client_reset_takes_its_done_back(core_stack: CoreStack, autojump_clock: MockClock) -> None:
    engine, link = core_stack.engine, core_stack.api.engine
    engine._on_input(ClientDone(0))
    engine._on_input(ClientReset(0))  # a new process holds index 0 and has said nothing
    await trio.sleep(2)
    assert link.retired == set() and link.up_engines() == [0]
    reply = await (await core_stack.client()).request(CHAT, chat_body(3))
    assert reply.status == 200


def _sent(client: EngineClient, now: float = 0.0) -> list[tuple[int, EngineInput]]:
    codec = engine_input_codec()
    out = []
    while (item := client.next_frame(client.dispatchable(now), now)) is not None:
        out.append((item[0], codec.decode(item[1])))
    return out


async def test_a_draining_replica_gets_done_after_the_adds_placed_there(autojump_clock: MockClock) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        client = _client(ctx)
        _join(client, _ready(0), _ready(1))
        client.add(_add("fixed-on-1"), replica=1)  # reserved at admission, not sent yet
        client.resize(1, epoch=1)
        client.add(_add("after"))
        sent = _sent(client)
        assert [(e, type(m).__name__) for e, m in sent] == [
            (1, "AddRequest"),
            (1, "ClientDone"),
            (0, "AddRequest"),
        ]
        assert client.dispatchable(trio.current_time()) == [0]
        inventory = client.inventory(trio.current_time())
        assert inventory["desired"] == 1 and inventory["capacity"] == 2
        data = inventory["data"]
        assert isinstance(data, list)
        assert [d["state"] for d in data] == ["ready", "draining"]
        client.resize(2, epoch=0)  # a roster older than the one held: ignored
        assert client.roster.desired == 1
        # Its requests finish; it says EngineRetired: gone, without a failure, no longer shown.
        failed: list[object] = []
        client._on_dead = lambda reason, ids, retry: failed.append((reason, ids))
        client.finished("fixed-on-1")
        client._retired(EngineRetired(1).engine_index)
        assert client.retired == {1} and failed == []
        data = client.inventory(trio.current_time())["data"]
        assert isinstance(data, list)
        assert [d["index"] for d in data] == [0]
        # Wanted again: its new engine joins and takes requests; nothing more is owed it.
        client.resize(2, epoch=2)
        _join(client, _ready(1))
        client.add(_add("a"))
        client.add(_add("b"))
        assert sorted(e for e, _ in _sent(client)) == [0, 1]
    finally:
        ctx.destroy(linger=0)


async def test_a_draining_replica_that_joins_again_is_owed_done_again(autojump_clock: MockClock) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        client = _client(ctx)
        _join(client, _ready(0))
        client.resize(1, epoch=1)
        assert _sent(client) == []  # rank 1 never joined: nothing to send
        _join(client, _ready(1))  # it joins this client late (a restarted API server, say)
        assert [(e, type(m).__name__) for e, m in _sent(client)] == [(1, "ClientDone")]
        assert client.up_engines() == [0]
    finally:
        ctx.destroy(linger=0)
