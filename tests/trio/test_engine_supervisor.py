"""``EngineSupervisor``'s rules on a MockClock, with a fake process and a fake engine link: when it
restarts and after how long, what it reports, when it kills, and when it gives up."""

from __future__ import annotations

import itertools

import pytest
import trio
from trio.testing import MockClock

from trioserve.frontend.engine_health import Stall
from trioserve.launch.engine_supervisor import (
    DEAD_GRACE,
    STOP_GRACE,
    EngineStartupError,
    EngineSupervisor,
    RestartBackoff,
)
from trioserve.runtime.sync import Waker

_pids = itertools.count(1000)


class FakeProcess:
    def __init__(self) -> None:
        self.pid = next(_pids)
        self.returncode: int | None = None
        self.signals: list[str] = []
        self.stubborn = False  # ignores SIGTERM
        self._exited = trio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    def terminate(self) -> None:
        self.signals.append("TERM")
        if not self.stubborn:
            self.exit(-15)

    def kill(self) -> None:
        self.signals.append("KILL")
        self.exit(-9)


class FakeLink:
    def __init__(self) -> None:
        self.joins = 0
        self.dead_report: str | None = None
        self.silence = 0.0  # seconds since the engine last said anything
        self.overdue = False  # the engine reports its running step overdue
        self._changed = Waker()

    def stall(self, now: float | None = None) -> Stall | None:
        if self.silence <= 3.0 and not self.overdue:
            return None
        return Stall(0, self.silence, 3.0, step_tokens=8 if self.overdue else 0)

    async def link_changed(self) -> None:
        await self._changed.wait()

    def join(self) -> None:
        self.joins += 1
        self.dead_report = None
        self._changed.set()

    def report_dead(self, reason: str) -> None:
        self.dead_report = reason
        self._changed.set()


class Harness:
    def __init__(self, **kwargs: object) -> None:
        self.link = FakeLink()
        self.procs: list[FakeProcess] = []
        self.spawned_at: list[float] = []
        self._spawned = Waker()
        self.deaths: list[tuple[str, int]] = []
        self.supervisor = EngineSupervisor(
            self.spawn,
            self.link,
            lambda reason, retry_after: self.deaths.append((reason, retry_after)),
            **kwargs,  # type: ignore[arg-type]
        )

    async def spawn(self) -> FakeProcess:
        await trio.lowlevel.checkpoint()
        proc = FakeProcess()
        self.procs.append(proc)
        self.spawned_at.append(trio.current_time())
        self._spawned.set()
        return proc

    async def next_process(self, count: int) -> FakeProcess:
        """Until the ``count``-th process has been spawned."""
        while len(self.procs) < count:
            await self._spawned.wait()
        return self.procs[count - 1]


async def test_a_dead_engine_is_restarted_with_a_doubling_backoff(autojump_clock: MockClock) -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        first = await h.next_process(1)
        await trio.sleep(2.0)  # it loads its model ...
        h.link.join()  # ... and joins
        await trio.sleep(1.0)
        first.exit(1)
        for n in range(2, 5):  # three replacements that die before joining
            proc = await h.next_process(n)
            await trio.sleep(0.1)
            proc.exit(1)
        await h.next_process(5)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(h.spawned_at)]
    assert gaps == [3.0 + 0.5, 0.1 + 1.0, 0.1 + 2.0, 0.1 + 4.0]
    assert h.supervisor.restarts == 4
    # Retry-After: the delay plus the 2 s the last engine took to join, rounded up.
    assert h.deaths == [
        ("the engine process exited with code 1", 3),
        ("the engine process exited with code 1", 3),
        ("the engine process exited with code 1", 4),
        ("the engine process exited with code 1", 6),
    ]


async def test_an_engine_that_stayed_up_restarts_after_the_base_delay(autojump_clock: MockClock) -> None:
    h = Harness(backoff=RestartBackoff(reset_after=60.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        for n in range(1, 4):  # each dies 1 s after joining: 0.5, 1
            proc = await h.next_process(n)
            h.link.join()
            await trio.sleep(1.0)
            proc.exit(1)
        proc = await h.next_process(4)
        h.link.join()
        await trio.sleep(60.0)  # this one serves for a minute
        proc.exit(-9)
        await h.next_process(5)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(h.spawned_at)]
    assert gaps == [1.5, 2.0, 3.0, 60.5]
    assert h.deaths[-1][0] == "the engine process was killed by signal 9"


async def test_never_reports_the_failure_and_starts_nothing(autojump_clock: MockClock) -> None:
    h = Harness(restart="never")
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        proc = await h.next_process(1)
        h.link.join()
        proc.exit(-9)
        with trio.fail_after(1):
            await h.supervisor.failed.wait()
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert len(h.procs) == 1
    assert h.supervisor.failure == "the engine process was killed by signal 9"
    assert h.deaths == [("the engine process was killed by signal 9", 1)]


async def test_a_first_engine_that_never_joined_is_a_startup_error(autojump_clock: MockClock) -> None:
    h = Harness()
    with pytest.RaisesGroup(pytest.RaisesExc(EngineStartupError, match="exited with code 2 during start-up")):
        async with trio.open_nursery() as nursery:
            await nursery.start(h.supervisor.run)
            (await h.next_process(1)).exit(2)
    assert h.deaths == []


async def test_an_engine_that_reported_death_but_lingers_is_terminated(autojump_clock: MockClock) -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        proc = await h.next_process(1)
        h.link.join()
        await trio.sleep(1.0)
        h.link.report_dead("engine 0 failed: worker 0 died (killed by signal 9)")
        reported = trio.current_time()
        await h.next_process(2)
        nursery.cancel_scope.cancel()
    assert proc.signals == ["TERM"]
    assert h.spawned_at[1] - reported == pytest.approx(DEAD_GRACE + 0.5)
    assert h.deaths == [("the engine process was killed by signal 15", 1)]


async def test_a_restarted_engine_that_does_not_join_in_time_is_killed(autojump_clock: MockClock) -> None:
    h = Harness(ready_timeout=10.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        first = await h.next_process(1)
        h.link.join()
        first.exit(1)
        hung = await h.next_process(2)  # never joins
        third = await h.next_process(3)
        cancelled = trio.current_time()
        nursery.cancel_scope.cancel()
    assert hung.signals == ["KILL"]
    assert h.spawned_at[2] - h.spawned_at[1] == pytest.approx(10.0 + 1.0)  # then the run's 2nd delay
    assert third.signals == ["TERM"]  # cancelled before it joined: nobody told it to stop, no wait
    assert trio.current_time() == cancelled


async def test_after_stop_an_exit_is_not_a_failure(autojump_clock: MockClock) -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        proc = await h.next_process(1)
        h.link.join()
        h.supervisor.stop()
        proc.exit(0)  # told to shut down by the engine client
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert len(h.procs) == 1
    assert h.deaths == []
    assert not h.supervisor.failed.is_set()


async def test_cancelled_it_waits_for_a_joined_engine_then_escalates(autojump_clock: MockClock) -> None:
    h = Harness()
    start = 0.0
    async with trio.open_nursery() as nursery:
        await nursery.start(h.supervisor.run)
        proc = await h.next_process(1)
        h.link.join()
        proc.stubborn = True  # it ignores ShutdownEngine and SIGTERM
        start = trio.current_time()
        nursery.cancel_scope.cancel()
    assert proc.signals == ["TERM", "KILL"]
    assert trio.current_time() - start == pytest.approx(2 * STOP_GRACE)


async def test_an_engine_silent_past_the_timeout_is_killed_and_replaced(autojump_clock: MockClock) -> None:
    harness = Harness(silence_timeout=30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.supervisor.run)
        first = await harness.next_process(1)
        harness.link.join()
        harness.link.silence = 20.0  # stalled (e.g. SIGSTOP), not yet past the limit
        await trio.sleep(5)
        assert first.returncode is None
        harness.link.silence = 31.0
        await trio.sleep(2)
        assert first.returncode == -9  # killed ...
        await harness.next_process(2)  # ... and, being dead, restarted
        assert harness.deaths and "killed by signal 9" in harness.deaths[0][0]
        nursery.cancel_scope.cancel()


async def test_an_overdue_step_is_not_the_supervisors_to_end(autojump_clock: MockClock) -> None:
    harness = Harness(silence_timeout=30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(harness.supervisor.run)
        first = await harness.next_process(1)
        harness.link.join()
        harness.link.silence = 100.0
        harness.link.overdue = True  # the engine core talks; its worker's step is late
        await trio.sleep(10)
        assert first.returncode is None
        nursery.cancel_scope.cancel()
