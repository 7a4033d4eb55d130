"""The engine client's replica rules (frontend/engine_client.py with frontend/replica_pool.py), on a
MockClock and without sockets: an engine that reports other batch limits is kept out of dispatch while
another is up; a request's deadline ends it through ``on_timeout`` and backs its replica off; an add
reserved for a replica goes there whatever the policy would pick; the inventory reports all of it."""

from __future__ import annotations

import trio
import zmq
from trio.testing import MockClock

from trioserve.frontend.dispatch import make_policy
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.replica_health import OutlierRules
from trioserve.frontend.replica_pool import ReplicaPool
from trioserve.protocol.messages import AddRequest, EngineReady, SamplingParams


def _client(ctx: zmq.Context[zmq.Socket[bytes]], timeout_s: float | None = None) -> EngineClient:
    return EngineClient(
        ctx,
        handshake_address=None,
        input_address="inproc://unused-in",
        output_address="inproc://unused-out",
        num_engines=2,
        policy=make_policy("round-robin", 2, 1, 0),
        pool=ReplicaPool(OutlierRules(), 2, timeout_s),
        devices=("cpu:0", "cpu:1"),
        batch_limits=(8, 256),
    )


def _ready(index: int, seqs: int = 8, tokens: int = 256) -> EngineReady:
    return EngineReady(index, 1000 + index, "mock", 512, seqs, 1000, max_num_batched_tokens=tokens)


def _join(client: EngineClient, *readys: EngineReady) -> None:
    """Each Ready as the ROUTER's owner reads it; the ClientResets it owes are dropped (no socket)."""
    for ready in readys:
        client._on_ready(ready)
    client._resets.clear()


def _add(rid: str) -> AddRequest:
    return AddRequest(rid, [1, 2], SamplingParams(max_tokens=4), 0.0)


async def test_other_batch_limits_keep_a_replica_out_of_dispatch(autojump_clock: MockClock) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        client = _client(ctx)
        _join(client, _ready(0), _ready(1, seqs=16))
        now = trio.current_time()
        assert client.dispatchable(now) == [0]
        inventory = client.inventory(now)
        data = inventory["data"]
        assert isinstance(data, list)
        assert data[1]["excluded"] == "reported max_num_seqs 16, not 8"
        assert data[0]["excluded"] is None
        assert [d["device"] for d in data] == ["cpu:0", "cpu:1"]
        assert inventory["ready"] == 2 and inventory["dispatchable"] == 1
        # Joining again with the deployment's limits clears it (after the backoff its death began).
        client.engine_died(1, "restarted")
        await trio.sleep(0.1)
        _join(client, EngineReady(1, 2001, "mock", 512, 8, 1000, max_num_batched_tokens=256))
        assert client.dispatchable(trio.current_time()) == [0, 1]
        # The only engine up is served through even with other limits (else nothing would be).
        client.engine_died(0, "gone")
        _join(client, EngineReady(1, 3001, "mock", 512, 8, 1000, max_num_batched_tokens=512))
        assert client.mismatched == {1: "reported max_num_batched_tokens 512, not 256"}
        assert client.dispatchable(trio.current_time()) == [1]
    finally:
        ctx.destroy(linger=0)


async def test_a_deadline_fails_the_request_and_backs_its_replica_off(autojump_clock: MockClock) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        client = _client(ctx, timeout_s=0.5)
        _join(client, _ready(0), _ready(1))
        timed_out: list[tuple[list[str], str]] = []
        client.on_timeout = lambda ids, why: timed_out.append((ids, why))
        client.add(_add("a"), replica=1)  # reserved at admission: round-robin would pick 0
        client.add(_add("b"), timeout_s=2.0)  # the deployment's 0.5 s is smaller
        first = client.next_frame(client.dispatchable(trio.current_time()), trio.current_time())
        second = client.next_frame(client.dispatchable(trio.current_time()), trio.current_time())
        assert first is not None and second is not None
        assert (first[0], second[0]) == (1, 0)
        assert client.pool.exchanges["b"].timeout_s == 0.5
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._watch_exchanges)
            await trio.sleep(0.4)
            client.pool.output("b", True, trio.current_time())  # b answers in time
            await trio.sleep(0.15)  # a's deadline passed at 0.5: backed off until 0.6
            assert timed_out == [(["a"], "replica 1 gave no output within the request's deadline")]
            now = trio.current_time()
            assert client.pool.book.state(1, now) == "backoff"
            assert client.dispatchable(now) == [0]
            # The probe the backoff asked for is queued for replica 1, dispatchable or not.
            assert [engine for engine, _, _ in client._probes] == [1]
            probe = client.next_frame(client.dispatchable(now), now)
            assert probe is not None and probe[0] == 1
            nursery.cancel_scope.cancel()
        assert client.inventory(trio.current_time())["data"][1]["timeouts_total"] == 1  # type: ignore[index]
    finally:
        ctx.destroy(linger=0)


async def test_an_engine_that_dies_fails_the_adds_reserved_for_it() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        client = _client(ctx)
        _join(client, _ready(0), _ready(1))
        failed: list[list[str] | None] = []
        client._on_dead = lambda reason, ids, retry_after: failed.append(ids)
        client.add(_add("queued"), replica=1)
        client.engine_died(1, "killed")
        assert failed == [["queued"]]
        assert client.queued_adds == 0
        assert client.next_frame([0], trio.current_time()) is None
    finally:
        ctx.destroy(linger=0)
