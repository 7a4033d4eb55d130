"""KV events through the DP coordinator's shell (``coordinator/main.py``) to an API server's ``prefix``
policy (``frontend/coordinator_link.py``): the publisher's order and cadence on the MockClock, then
real ipc sockets in real time (no timing assertions)."""

from __future__ import annotations

import trio
import trio.testing
import zmq

from trioserve.coordinator.core import CoordinatorCore
from trioserve.coordinator.main import Coordinator, CoordinatorLaunch, publish_loop
from trioserve.frontend.coordinator_link import LinkStats, follow_coordinator
from trioserve.frontend.dispatch import PrefixAware, RequestKey
from trioserve.frontend.engine_client import EngineClient
from trioserve.protocol.block_hash import prefix_block_keys
from trioserve.protocol.codec import coordinator_input_codec, coordinator_output_codec
from trioserve.protocol.messages import (
    AddRequest,
    EngineReady,
    KvEvents,
    LoadReport,
    LoadSnapshot,
    SamplingParams,
)
from trioserve.runtime.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket

from .test_coordinator import Ctx, _until, ctx, ipc_dir  # noqa: F401  (fixtures)


async def test_kv_events_go_out_right_after_the_snapshot_they_came_with(
    autojump_clock: trio.testing.MockClock,
) -> None:
    core = CoordinatorCore(2)
    wake = Waker()
    sent: list[tuple[float, LoadSnapshot | KvEvents]] = []
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(publish_loop, core, wake, lambda m: sent.append((trio.current_time() - t0, m)))
        await trio.sleep(0.05)
        core.kv(KvEvents(1, [5, 6], [], True, 1))  # a change: due one interval after the first
        wake.set()
        await trio.sleep(0.01)
        core.kv(KvEvents(0, [7], [], True, 1))  # the same interval: the same publication
        wake.set()
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    kinds = [(round(t, 6), type(m).__name__, getattr(m, "engine_index", None)) for t, m in sent]
    assert kinds == [
        (0.0, "LoadSnapshot", None),
        (0.1, "LoadSnapshot", None),
        (0.1, "KvEvents", 0),
        (0.1, "KvEvents", 1),
    ]


async def test_an_engines_cached_prefix_steers_the_api_servers_pick(ctx: Ctx, ipc_dir: str) -> None:  # noqa: F811
    launch = CoordinatorLaunch(
        engines_address=f"ipc://{ipc_dir}/in",
        publish_address=f"ipc://{ipc_dir}/out",
        num_engines=2,
        log_level="info",
    )
    coordinator = Coordinator(launch, ctx)
    policy = PrefixAware(2)
    stats = LinkStats()
    codec = coordinator_input_codec()
    engines = [TrioZmqSocket.create(ctx, zmq.PUSH, connect=launch.engines_address) for _ in range(2)]
    key = RequestKey((11, 12, 13), 49, 16)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(coordinator.run)
            await nursery.start(
                lambda task_status: follow_coordinator(
                    ctx, launch.publish_address, policy, stats=stats, task_status=task_status
                )
            )
            assert policy.pick({0, 1}, key) == 0  # nobody holds it: dplb's pick
            # Engine 1 reports the blocks (LoadReports share the socket); a bad one is dropped.
            await engines[1].send_multipart([codec.encode(LoadReport(1, 0, 0, 0.0))])
            await engines[1].send_multipart([codec.encode(KvEvents(1, [11, 12, 13], [], True, 1))])
            await engines[0].send_multipart([codec.encode(KvEvents(5, [1], [], False, 1))])  # no such engine
            await _until(lambda: policy.index.match(1, key.blocks) == 3)
            assert policy.pick({0, 1}, key) == 1
            assert stats.kv_received >= 1
            await _until(lambda: coordinator.core.bad_kv == 1)
            # An eviction reaches it too: the prefix is one block shorter.
            await engines[1].send_multipart([codec.encode(KvEvents(1, [], [13], False, 2))])
            await _until(lambda: policy.index.match(1, key.blocks) == 2)
            nursery.cancel_scope.cancel()
    finally:
        for sock in engines:
            sock.close()


async def test_the_link_counts_a_gap_in_kv_events_and_applies_every_one(ctx: Ctx) -> None:  # noqa: F811
    address = "inproc://coordinator-kv-link-test"
    pub = TrioZmqSocket.create(ctx, zmq.PUB, bind=address)
    codec = coordinator_output_codec()
    policy = PrefixAware(2)
    stats = LinkStats()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: follow_coordinator(
                    ctx, address, policy, stats=stats, task_status=task_status
                )
            )
            while stats.received == 0:  # until the subscription has reached the PUB
                pub.try_send_multipart([codec.encode(LoadSnapshot(0, []))])
                await trio.sleep(0.01)
            for message in (
                KvEvents(0, [1], [], True, 10),
                KvEvents(0, [2], [], False, 11),
                KvEvents(0, [3], [], False, 13),  # 12 was lost
                LoadSnapshot(1, []),
            ):
                assert pub.try_send_multipart([codec.encode(message)])
            await _until(lambda: stats.kv_received == 3)
            assert stats.kv_gaps == 1
            assert stats.last_kv_seq == 13
            assert policy.index.match(0, (1, 2, 3)) == 3  # every one applied, in order
            nursery.cancel_scope.cancel()
    finally:
        pub.close()


def test_the_engine_client_hands_each_adds_own_key_to_pick(ctx: Ctx) -> None:  # noqa: F811
    """``EngineClient.add`` asks the policy for the request's key once; ``next_frame`` picks for the
    oldest add still queued (skipping one an abort dropped) with that add's key."""
    policy = PrefixAware(2)
    client = EngineClient(
        ctx,
        handshake_address=None,
        input_address="inproc://unused-in",
        output_address="inproc://unused-out",
        num_engines=2,
        policy=policy,
    )
    client.engines = {i: EngineReady(i, 10 + i, "model", 2048, 8, 1000, 64, 16) for i in range(2)}
    system = list(range(500, 564))  # 4 blocks of 16
    policy.apply_kv(KvEvents(1, prefix_block_keys([*system, 1], 16), [], True))

    def add(rid: str, prompt: list[int]) -> None:
        client.add(AddRequest(rid, prompt, SamplingParams(4), 0.0))

    add("dropped", [*system, 7, 7])  # aborted while queued: never picked for
    add("same", [*system, 8, 8])  # engine 1 holds its prefix (dplb alone would pick engine 0)
    add("other", list(range(9000, 9100)))  # nobody holds it: dplb's pick, engine 0 (1 is busier)
    client.abort(["dropped"])
    sent = [client.next_frame({0, 1}) for _ in range(2)]
    assert [engine for engine, _ in (s for s in sent if s is not None)] == [1, 0]
    assert client.next_frame({0, 1}) is None
    assert policy.load.in_flight(1) == 1 and policy.load.in_flight(0) == 1
    assert client.dropped_adds == 1
