"""The DP coordinator's shell (``coordinator/main.py``) and the API server's link to it
(``frontend/coordinator_link.py``).

The publication cadence is checked on the MockClock with the publisher loop alone (no sockets); the
shell runs on real ipc sockets in real time, with no timing assertions (its timing is the core's,
``tests/unit/test_coordinator_core.py``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import trio
import trio.testing
import zmq

from trioserve.coordinator.core import CoordinatorCore
from trioserve.coordinator.main import Coordinator, CoordinatorLaunch, publish_loop
from trioserve.frontend.coordinator_link import LinkStats, follow_coordinator
from trioserve.frontend.dispatch import DpScore
from trioserve.protocol.codec import load_report_codec, load_snapshot_codec
from trioserve.protocol.messages import LoadReport, LoadSnapshot
from trioserve.runtime.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    # ipc:// paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="tsc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Polls ``condition`` (real sockets, real time); the timeout only guards against a hang."""
    with trio.fail_after(timeout):
        # Polling: the state lives in another task's objects (and behind sockets), with no event.
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_publish_loop_cadence(autojump_clock: trio.testing.MockClock) -> None:
    core = CoordinatorCore(2)
    wake = Waker()
    sent: list[tuple[float, LoadSnapshot]] = []
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(publish_loop, core, wake, lambda s: sent.append((trio.current_time() - t0, s)))
        await trio.sleep(0.05)
        core.report(LoadReport(0, 1, 1, 0.0))
        wake.set()
        await trio.sleep(0.01)
        core.report(LoadReport(1, 0, 2, 0.0))  # in the same interval: the same publication
        wake.set()
        await trio.sleep(0.5)
        core.report(LoadReport(1, 0, 3, 0.0))  # > an interval after the last: at once
        wake.set()
        await trio.sleep(2.3)  # ends between two keep-alives, not on one
        nursery.cancel_scope.cancel()
    times = [round(t, 6) for t, _ in sent]
    assert times == [0.0, 0.1, 0.56, 1.56, 2.56]  # start, change, change, keep-alive, keep-alive
    assert [s.seq for _, s in sent] == [1, 2, 3, 4, 5]
    assert sent[1][1].engines == [LoadReport(0, 1, 1, 0.0), LoadReport(1, 0, 2, 0.0)]
    assert sent[-1][1].engines == [LoadReport(0, 1, 1, 0.0), LoadReport(1, 0, 3, 0.0)]


async def test_api_server_sees_both_engines_loads(ctx: Ctx, ipc_dir: str) -> None:
    launch = CoordinatorLaunch(
        engines_address=f"ipc://{ipc_dir}/loads",
        publish_address=f"ipc://{ipc_dir}/pub",
        num_engines=2,
        log_level="info",
    )
    coordinator = Coordinator(launch, ctx)
    policy = DpScore(2)
    stats = LinkStats()
    codec = load_report_codec()
    engines = [TrioZmqSocket.create(ctx, zmq.PUSH, connect=launch.engines_address) for _ in range(2)]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(coordinator.run)
            await nursery.start(
                lambda task_status: follow_coordinator(
                    ctx, launch.publish_address, policy, stats=stats, task_status=task_status
                )
            )
            await engines[0].send_multipart([b"\x93garbage"])  # dropped and counted; the shell goes on
            await engines[0].send_multipart([codec.encode(LoadReport(0, 3, 1, 0.8))])
            await engines[1].send_multipart([codec.encode(LoadReport(1, 0, 2, 0.1))])
            await engines[1].send_multipart([codec.encode(LoadReport(7, 0, 2, 0.1))])  # no such engine

            def both() -> bool:
                return policy.coordinator_load(0) == (3, 1, 0.8) and policy.coordinator_load(1) == (0, 2, 0.1)

            await _until(both)
            assert coordinator.bad_frames == 1
            await _until(lambda: coordinator.core.bad_reports == 1)
            # 3 waiting + 1 running + 3 x 6 x 0.3 against 2 running.
            assert policy.score(0) == pytest.approx(4 + 5.4)
            assert policy.pick({0, 1}) == 1
            assert stats.applied >= 1
            assert stats.bad_frames == 0
            assert stats.last_seq is not None
            assert stats.age(trio.current_time()) is not None
            # A change reaches the API server too.
            await engines[1].send_multipart([codec.encode(LoadReport(1, 9, 9, 0.1))])
            await _until(lambda: policy.coordinator_load(1) == (9, 9, 0.1))
            assert policy.pick({0, 1}) == 0
            nursery.cancel_scope.cancel()
    finally:
        for sock in engines:
            sock.close()


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.updates: list[int] = []

    def pick(self, ready: object) -> int | None:
        return None

    def sent(self, engine: int) -> None:
        pass

    def done(self, engine: int) -> None:
        pass

    def update(self, snapshot: LoadSnapshot) -> None:
        self.updates.append(snapshot.seq)


async def test_link_applies_only_the_newest_of_a_queue_and_drops_bad_frames(ctx: Ctx) -> None:
    pub = TrioZmqSocket.create(ctx, zmq.PUB, bind="inproc://coordinator-link-test")
    codec = load_snapshot_codec()
    policy = _Recorder()
    stats = LinkStats()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: follow_coordinator(
                    ctx, "inproc://coordinator-link-test", policy, stats=stats, task_status=task_status
                )
            )
            # Until the subscription has reached the PUB (before that it drops what it sends).
            while not policy.updates:
                pub.try_send_multipart([codec.encode(LoadSnapshot(0, []))])
                await trio.sleep(0.01)
            applied = stats.applied
            # Queued with no checkpoint in between: the link wakes once and finds all four.
            for frame in (
                codec.encode(LoadSnapshot(1, [])),
                b"not msgpack",
                codec.encode(LoadSnapshot(2, [])),
                codec.encode(LoadSnapshot(3, [LoadReport(0, 1, 1, 0.0)])),
            ):
                assert pub.try_send_multipart([frame])
            await _until(lambda: stats.applied > applied)
            assert policy.updates[-1] == 3
            assert 1 not in policy.updates
            assert 2 not in policy.updates
            assert stats.applied == applied + 1
            assert stats.bad_frames == 1
            assert stats.last_seq == 3
            nursery.cancel_scope.cancel()
    finally:
        pub.close()
