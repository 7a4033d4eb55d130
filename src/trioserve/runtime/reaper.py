"""Ending a child process for good: the one reaper every process that starts another uses (the API
server's engine supervisor for its engine core, the engine core for its workers).

Rule. ``reap(proc, grace=g, term_grace=t)``:

1. waits up to ``g`` seconds for ``proc`` to exit by itself (it was asked to stop some other way: a
   shutdown message; 0 skips the wait);
2. then sends SIGTERM and waits up to ``t`` seconds (``None`` skips SIGTERM: a process that is
   stopped or hung would not act on it, and one that was told nothing has nothing to finish);
3. then sends SIGKILL;

and returns the exit code once the process has exited, never earlier: no process is left behind, and
none is left a zombie. It is shielded from cancellation, so it runs to the end even when its caller
is being cancelled (shutdown is exactly when it runs). Each step is skipped once the process has
exited.

Written against ``Reapable`` (``trio.Process`` has it), so its rules run on a MockClock with a fake.
"""

from __future__ import annotations

from typing import Protocol

import trio

TERM_GRACE = 3.0  # seconds between SIGTERM and SIGKILL


class Reapable(Protocol):
    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


async def reap(proc: Reapable, *, grace: float = 0.0, term_grace: float | None = TERM_GRACE) -> int:
    """Wait ``grace`` seconds, SIGTERM and wait ``term_grace`` seconds, SIGKILL; the module's rule."""
    with trio.CancelScope(shield=True):
        if proc.returncode is None and grace > 0:
            with trio.move_on_after(grace):
                await proc.wait()
        if proc.returncode is None and term_grace is not None:
            proc.terminate()
            with trio.move_on_after(term_grace):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
        code = await proc.wait()
    return code
