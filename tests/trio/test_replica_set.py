"""The supervisor's resize shell (launch/resize.py's ``ReplicaSet``) on a MockClock, with fakes of
an engine supervisor and of the supervisor's engine client: a grown rank starts as a restartable
replica; a retired one that drains is gone without a death notice; one that does not drain within
``drain_timeout`` is told to shut down, and what it held is failed."""

from __future__ import annotations

from typing import Any

import trio
from trio.testing import MockClock

from trioserve.launch.resize import ReplicaSet
from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.messages import ReplicaRoster


class FakeSupervisor:
    def __init__(self, rank: int, at_start: bool) -> None:
        self.rank, self.at_start = rank, at_start
        self.stopped = False
        self.exit = trio.Event()
        self.failure: str | None = None

    def stop(self) -> None:
        self.stopped = True

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await self.exit.wait()


class FakeLink:
    def __init__(self) -> None:
        self.retired: set[int] = set()
        self.rosters: list[tuple[int, int]] = []
        self.shut: list[int] = []
        self.died: list[tuple[int, str]] = []
        self.supervisors: dict[int, FakeSupervisor] = {}

    def resize(self, desired: int, epoch: int) -> None:
        self.rosters.append((desired, epoch))

    def shut_down(self, rank: int) -> None:
        self.shut.append(rank)
        self.supervisors[rank].exit.set()  # it stops after its step

    def engine_died(self, rank: int, reason: str) -> None:
        self.died.append((rank, reason))


class FakeSocket:
    def __init__(self) -> None:
        self.frames: list[Any] = []

    def try_send_multipart(self, frames: list[bytes]) -> bool:
        self.frames.append(engine_output_codec().decode(frames[0]))
        return True


def _set(link: FakeLink, sock: FakeSocket, notified: list[tuple[int, str]]) -> ReplicaSet:
    def make(rank: int, at_start: bool) -> Any:
        sup = link.supervisors[rank] = FakeSupervisor(rank, at_start)
        return sup

    return ReplicaSet(
        make,
        link,  # type: ignore[arg-type]
        [sock],  # type: ignore[list-item]
        desired=1,
        drain_timeout=30.0,
        notify_dead=lambda rank, reason: notified.append((rank, reason)),
    )


async def test_grow_then_a_drained_retirement(autojump_clock: MockClock) -> None:
    link, sock, notified = FakeLink(), FakeSocket(), []  # type: ignore[var-annotated]
    replicas = _set(link, sock, notified)
    async with trio.open_nursery() as nursery:
        await replicas.start(nursery, [0])
        assert link.supervisors[0].at_start
        await replicas.resize(2)
        assert not link.supervisors[1].at_start  # a replica a resize adds is restarted, never fatal
        assert sock.frames == [ReplicaRoster(2, 1)] and link.rosters == [(2, 1)]

        async def drain() -> None:
            await trio.sleep(5)
            link.retired.add(1)  # EngineRetired reached the supervisor's link
            link.supervisors[1].exit.set()  # and the process exited by itself

        nursery.start_soon(drain)
        began = trio.current_time()
        await replicas.resize(1)
        assert trio.current_time() - began == 5
        assert link.supervisors[1].stopped and link.shut == [] and notified == [] and link.died == []
        assert sock.frames[-1] == ReplicaRoster(1, 2)
        assert sorted(replicas.supervisors) == [0]
        nursery.cancel_scope.cancel()


async def test_a_replica_that_does_not_drain_is_shut_down_and_its_requests_fail(
    autojump_clock: MockClock,
) -> None:
    link, sock, notified = FakeLink(), FakeSocket(), []  # type: ignore[var-annotated]
    replicas = _set(link, sock, notified)
    async with trio.open_nursery() as nursery:
        await replicas.start(nursery, [0])
        await replicas.resize(2)
        began = trio.current_time()
        await replicas.resize(1)
        assert trio.current_time() - began == 30  # --drain-timeout
        assert link.shut == [1]
        reason = "replica 1 stopped before it drained"
        assert notified == [(1, reason)] and link.died == [(1, reason)]
        replicas.stop()
        await replicas.resize(2)  # shutting down: no resize starts
        assert replicas.desired == 1
        nursery.cancel_scope.cancel()
