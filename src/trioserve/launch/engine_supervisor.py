"""The API server's engine-core process: start it, notice when it dies, and restart it with backoff.

An engine is *dead* when its process exits, or when the API server hears it report a fatal error
(``EngineDead``, or its socket became unreachable): it then has ``DEAD_GRACE`` seconds to exit by
itself before it is terminated. By then every request in flight has failed with an error event (the
engine client's ``on_dead``), and until a replacement joins new requests and ``/health`` get 503 with
``Retry-After``. What happens next is ``--engine-restart``:

- ``always`` (default): start a new engine core (it starts its own workers) after ``RestartBackoff``'s
  delay. The new process joins at the same handshake address; the engine client takes its handshake
  like the first one, and serving resumes when it is ready. A restarted engine that does not join
  within ``ready_timeout`` is killed, and counts as one more failure.
- ``never``: report the failure (``failed``) and start nothing; the API server drains and exits with
  code 1, for deployments whose own supervisor restarts processes.

An engine whose process is stopped or hung sends nothing (its heartbeats come every second, during
steps too); after ``silence_timeout`` seconds of that (``--worker-step-timeout``, the same hard bound
the engine core puts on a worker's step) it is killed, and so it is dead as above. ``/health`` has
answered 503 since the stall bound (seconds, not minutes) passed.

The first engine is different: one that exits before it ever joined is a start-up error (a bad model
path, say) and ends the API server whatever the policy (``EngineStartupError``); except for a
replica a resize adds (``startup_error=False``), which is restarted as above.

The shell is written against two small protocols, the process (``trio.Process``) and the link (the
engine client), so its rules run on a MockClock with fakes of both.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import trio

from trioserve.frontend.engine_health import Stall
from trioserve.runtime.reaper import TERM_GRACE, Reapable, reap

log = logging.getLogger("trioserve")

RestartPolicy = Literal["always", "never"]

DEAD_GRACE = 5.0  # seconds an engine that reported itself dead has to exit before it is terminated
SILENCE_CHECK = 1.0  # seconds between checks of an engine's silence against ``silence_timeout``
STOP_GRACE = (
    TERM_GRACE  # seconds between asking an engine to stop (ShutdownEngine, SIGTERM) and the next step
)


class EngineStartupError(RuntimeError):
    """The first engine process exited before it joined."""


class EngineFailed(RuntimeError):
    """The engine died under ``--engine-restart never``."""


@dataclass(slots=True)
class RestartBackoff:
    """How long to wait before starting the next engine.

    Rule: the n-th restart of a run waits ``min(base * 2 ** (n - 1), cap)`` seconds (0.5, 1, 2, 4, ...,
    30 by default). A run ends, so the next failure waits ``base`` again, when the engine that failed
    had been up (joined) for at least ``reset_after`` seconds. An engine that never joined continues
    the run: a crash loop slows down to one attempt every ``cap`` seconds.

    Pure: the caller passes the times (its trio clock); nothing here sleeps.
    """

    base: float = 0.5
    cap: float = 30.0
    reset_after: float = 60.0
    streak: int = 0  # restarts in the current run
    up_since: float | None = None  # when the engine now running joined; None until it does

    def joined(self, now: float) -> None:
        self.up_since = now

    def failed(self, now: float) -> float:
        """The engine died at ``now``: the delay before the next one starts."""
        if self.up_since is not None and now - self.up_since >= self.reset_after:
            self.streak = 0
        self.up_since = None
        delay = min(self.base * 2.0 ** min(self.streak, 64), self.cap)
        self.streak += 1
        return delay


class EngineProcess(Reapable, Protocol):
    """What the supervisor needs of a process (``trio.Process`` has it)."""

    @property
    def pid(self) -> int: ...


class EngineLink(Protocol):
    """What the supervisor watches (the API server's ``EngineClient``)."""

    @property
    def joins(self) -> int:
        """Handshakes completed so far (one per engine that joined, restarts included)."""

    @property
    def dead_report(self) -> str | None:
        """Why the engine is dead, as heard over the link since the last join (None: not heard)."""

    async def link_changed(self) -> None:
        """Returns after ``joins`` or ``dead_report`` changed (perhaps before this call)."""

    def stall(self, now: float | None = None) -> Stall | None:
        """The engine's stall, if it is stalled (``frontend.engine_health``)."""


def exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class EngineSupervisor:
    def __init__(
        self,
        spawn: Callable[[], Awaitable[EngineProcess]],
        link: EngineLink,
        on_dead: Callable[[str, int], None],
        *,
        restart: RestartPolicy = "always",
        ready_timeout: float = 120.0,
        backoff: RestartBackoff | None = None,
        on_restart: Callable[[], None] = lambda: None,
        dead_grace: float = DEAD_GRACE,
        silence_timeout: float | None = None,
        startup_error: bool = True,
    ) -> None:
        self._spawn = spawn
        # False: a first engine that exits before it joined is restarted like any other (a replica
        # a resize adds: the tree serves already, docs/replicas.md), not a start-up error.
        self.startup_error = startup_error
        self.link = link
        self.on_dead = on_dead  # (reason, Retry-After seconds): fail in-flight requests, refuse new ones
        self.on_restart = on_restart
        self.restart = restart
        self.ready_timeout = ready_timeout
        self.backoff = backoff or RestartBackoff()
        self.dead_grace = dead_grace
        # An engine silent this long (its process stopped or hung: no step output, no heartbeat) is
        # killed, which the restart policy then handles like any death. None: never.
        self.silence_timeout = silence_timeout
        self.restarts = 0
        self.failed = trio.Event()  # set when an engine died under ``never``
        self.failure: str | None = None
        self.stopping = False
        self._startup = 0.0  # seconds the last engine took from spawn to join

    def stop(self) -> None:
        """Shutdown has begun: an engine that exits from now on is neither a failure nor restarted."""
        self.stopping = True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """``started`` once the first engine process runs (its handshake is the engine client's to
        wait for). Returns when stopping, or after a failure under ``never``; raises
        ``EngineStartupError`` if the first engine exits before it joined."""
        first = True
        while True:
            joins = self.link.joins
            spawned_at = trio.current_time()
            proc = await self._spawn()
            if first:
                task_status.started()
            else:
                log.warning("engine core restart %d: pid %d", self.restarts, proc.pid)
            try:
                await self._until_gone(proc, joins, spawned_at, None if first else self.ready_timeout)
            finally:
                # Cancelled (shutdown): a joined engine was told to stop by the engine client; give it
                # a moment. One that never joined was told nothing: no point waiting.
                await reap(proc, grace=STOP_GRACE if self.link.joins > joins else 0.0, term_grace=STOP_GRACE)
            first = False
            if self.stopping:
                return
            reason = f"the engine process {exit_text(proc.returncode)}"
            if self.link.joins == 0 and self.startup_error:
                raise EngineStartupError(f"{reason} during start-up")
            delay = self.backoff.failed(trio.current_time())
            # The next engine is expected after the delay plus the time the last one took to join.
            self.on_dead(reason, max(1, math.ceil(delay + self._startup)))
            if self.restart == "never":
                log.error("%s; --engine-restart never: the API server exits", reason)
                self.failure = reason
                self.failed.set()
                return
            log.warning("%s (pid %d); restarting it in %.1f s", reason, proc.pid, delay)
            await trio.sleep(delay)
            self.restarts += 1
            self.on_restart()

    async def _until_gone(
        self, proc: EngineProcess, joins: int, spawned_at: float, ready_timeout: float | None
    ) -> None:
        """Returns once ``proc`` has exited. Kills it if it does not join within ``ready_timeout``
        (None: the caller's own timeout applies), and terminates it if it reported itself dead but
        is still running ``dead_grace`` seconds later."""
        link = self.link
        async with trio.open_nursery() as nursery:

            async def exited() -> None:
                await proc.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(exited)
            if self.silence_timeout is not None:
                nursery.start_soon(self._kill_when_silent, proc, self.silence_timeout)
            deadline = math.inf if ready_timeout is None else trio.current_time() + ready_timeout
            while link.joins == joins:
                with trio.move_on_at(deadline):
                    await link.link_changed()
                if trio.current_time() >= deadline:
                    log.error(
                        "the engine process (pid %d) did not join in %g s; killing it",
                        proc.pid,
                        ready_timeout,
                    )
                    proc.kill()
                    await trio.sleep_forever()
            now = trio.current_time()
            self._startup = now - spawned_at
            self.backoff.joined(now)
            while link.dead_report is None:
                await link.link_changed()
            await trio.sleep(self.dead_grace)
            log.error(
                "the engine process (pid %d) reported itself dead %g s ago and is still running; "
                "terminating it",
                proc.pid,
                self.dead_grace,
            )
            await reap(proc, term_grace=STOP_GRACE)

    async def _kill_when_silent(self, proc: EngineProcess, timeout: float) -> None:
        """Rule: an engine from which nothing has arrived for ``timeout`` seconds is killed. Its
        heartbeats come every second, during steps too, so silence means the engine-core process
        itself is stopped or hung, and nothing else ends its requests (a worker's overdue step is
        the engine core's to end: ``--worker-step-timeout``). ``/health`` said 503 long before."""
        while True:
            await trio.sleep(SILENCE_CHECK)
            stall = self.link.stall()
            if stall is not None and not stall.overdue and stall.silence > timeout:
                log.error(
                    "the engine process (pid %d) has sent nothing for %.0f s (limit %g s); killing it",
                    proc.pid,
                    stall.silence,
                    timeout,
                )
                proc.kill()
                return
