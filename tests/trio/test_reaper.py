"""``runtime.reaper.reap``'s rule on a MockClock with a fake process: wait the grace, SIGTERM and wait,
SIGKILL, and return only once the process has exited, even when the caller is cancelled."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from trioserve.runtime.reaper import TERM_GRACE, reap


class FakeProcess:
    """Exits ``exits_after`` seconds after it was started (never if None), on SIGTERM unless
    ``stubborn``, and on SIGKILL."""

    def __init__(self, exits_after: float | None = None, *, stubborn: bool = False) -> None:
        self.returncode: int | None = None
        self.signals: list[tuple[str, float]] = []
        self.stubborn = stubborn
        self.exits_after = exits_after
        self._exited = trio.Event()

    async def run(self) -> None:
        if self.exits_after is not None:
            await trio.sleep(self.exits_after)
            self.exit(0)

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self.signals.append(("TERM", trio.current_time()))
        if not self.stubborn:
            self.exit(-15)

    def kill(self) -> None:
        self.signals.append(("KILL", trio.current_time()))
        self.exit(-9)


async def reaped(proc: FakeProcess, **kwargs: float | None) -> tuple[int, float]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proc.run)
        start = trio.current_time()
        code = await reap(proc, **kwargs)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
    return code, trio.current_time() - start


async def test_a_process_that_exits_within_the_grace_gets_no_signal(autojump_clock: MockClock) -> None:
    proc = FakeProcess(exits_after=2.0)
    assert await reaped(proc, grace=5.0) == (0, pytest.approx(2.0))
    assert proc.signals == []


async def test_after_the_grace_sigterm_then_sigkill(autojump_clock: MockClock) -> None:
    proc = FakeProcess(stubborn=True)
    code, took = await reaped(proc, grace=5.0)
    assert code == -9
    assert proc.signals == [("TERM", pytest.approx(5.0)), ("KILL", pytest.approx(5.0 + TERM_GRACE))]
    assert took == pytest.approx(5.0 + TERM_GRACE)


async def test_sigterm_suffices_for_a_process_that_acts_on_it(autojump_clock: MockClock) -> None:
    proc = FakeProcess()
    assert await reaped(proc, term_grace=3.0) == (-15, 0.0)  # no grace: SIGTERM at once
    assert [name for name, _ in proc.signals] == ["TERM"]


async def test_without_sigterm_it_goes_straight_to_sigkill(autojump_clock: MockClock) -> None:
    """For a worker that failed (hung, stopped) or was told nothing: SIGTERM would only be waited out."""
    proc = FakeProcess()
    assert await reaped(proc, term_grace=None) == (-9, 0.0)
    assert [name for name, _ in proc.signals] == ["KILL"]


async def test_an_exited_process_is_not_signalled(autojump_clock: MockClock) -> None:
    proc = FakeProcess()
    proc.exit(3)
    assert await reap(proc, grace=5.0) == 3
    assert proc.signals == []


async def test_a_cancelled_caller_still_reaps_to_the_end(autojump_clock: MockClock) -> None:
    proc = FakeProcess(stubborn=True)
    with trio.move_on_after(1.0):  # the caller is cancelled mid-grace: the reaper is shielded
        await reap(proc, grace=5.0, term_grace=2.0)
    assert proc.returncode == -9
    assert trio.current_time() == pytest.approx(7.0)
