"""Least-loaded accept across API servers that share one listening socket (seed 000, "Two API
servers, one socket"; vLLM's ``NoSignalServer.accept``).

The supervisor binds one listening socket and gives it to every API server, so they all share one
accept queue, and every one of them wakes when it becomes readable. Left alone, whichever process
the kernel runs first takes the connection. Instead, each API server publishes its number of open
connections (idle keep-alive ones included) in a shared array, ``ConnectionLoads``, and on each
wake asks ``AcceptDeferral`` whether to let a less loaded peer take this connection first.

Rule (``AcceptDeferral.defer``):

- A server is *least loaded* when its own count is <= every other slot. The least loaded server
  races for ``accept`` at once. Ties race: every tied server tries, one wins, the others find the
  queue empty (``BlockingIOError``), count a lost race, and go back to waiting.
- Any other server defers: it waits ``DEFER_INTERVAL`` (1 ms) and checks again, at most
  ``DEFER_CHECKS`` (5) times, then races anyway. So a wake costs it at most 5 ms, and a peer that
  does not accept (stuck, or gone with a low count) can delay connections by no more than that.
  A count that changes meanwhile (its own drops, a peer's rises) ends the deferral at that check.
- A slot holding ``ABSENT`` (never published, retired by a draining server, or by the supervisor
  for a dead one) is larger than any real count, so nobody ever defers to it: a server that is not
  accepting must not cost its peers 5 ms per connection.

The unit of balance is a TCP connection, decided once at accept time: every request on a keep-alive
connection goes to the server that accepted it (seed 000 calls this the trap for load generators
and proxies with a few pooled connections).

``AcceptDeferral`` is pure (no I/O, no sleeping); ``AcceptBalance`` is the thin Trio shell the
accept loop (``http_server.py``) calls between ``wait_readable`` and ``accept``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import trio

__all__ = [
    "ABSENT",
    "DEFER_CHECKS",
    "DEFER_INTERVAL",
    "SLOT_BYTES",
    "AcceptBalance",
    "AcceptDeferral",
    "ConnectionLoads",
]

DEFER_CHECKS = 5
"""Most 1 ms checks a server that is not the least loaded waits before racing anyway (vLLM's)."""
DEFER_INTERVAL = 0.001
"""Seconds between two checks of the loads while deferring."""
SLOT_BYTES = 8
ABSENT = 2**64 - 1
"""A slot's value for a server that is not accepting: never deferred to."""


class ConnectionLoads:
    """``count`` unsigned 64-bit slots in a file shared with ``mmap`` (slot ``i``: API server ``i``'s
    open connections). A plain file (e.g. ``<ipc_dir>/connections``), not
    ``multiprocessing.shared_memory``, which would start a resource-tracker process.

    Each slot has exactly one writer at a time: its API server (or, once that one is dead, the
    supervisor retiring it). Readers take no lock and may see a value that is a moment old. That is
    fine: the loads only steer a choice that is correct whichever server accepts, a stale value costs
    at most one connection going to the second-least-loaded server or one wait of at most 5 ms, and
    the next wake reads fresh values. Slots are 8-byte aligned in a page-aligned mapping, so a store
    is one machine word and a reader never sees half of one.
    """

    def __init__(self, path: Path, count: int, fd: int) -> None:
        """Use ``create`` or ``open``."""
        self.path = path
        self.count = count
        try:
            self._map = mmap.mmap(fd, count * SLOT_BYTES)
        finally:
            os.close(fd)  # the mapping keeps the file alive
        self._slots = memoryview(self._map).cast("Q")

    @classmethod
    def create(cls, path: str | os.PathLike[str], count: int) -> ConnectionLoads:
        """Make (or replace) the file for ``count`` API servers, every slot ``ABSENT``. The
        supervisor calls this once, before it starts any API server."""
        if count < 1:
            raise ValueError(f"need at least one API server, got {count}")
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, count * SLOT_BYTES)
        except BaseException:
            os.close(fd)
            raise
        loads = cls(path, count, fd)
        for i in range(count):
            loads._slots[i] = ABSENT
        return loads

    @classmethod
    def open(cls, path: str | os.PathLike[str], count: int) -> ConnectionLoads:
        """Map the file ``create`` made (each API server)."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if count < 1 or size != count * SLOT_BYTES:
                raise ValueError(f"{path} holds {size} bytes, not {count} slots of {SLOT_BYTES}")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, count, fd)

    def publish(self, index: int, value: int) -> None:
        """Store slot ``index`` (only its owner calls this)."""
        self._slots[index] = value

    def retire(self, index: int) -> None:
        """Mark slot ``index`` as not accepting (``ABSENT``): a draining server, or the supervisor
        for a dead one until its replacement publishes."""
        self._slots[index] = ABSENT

    def read(self) -> list[int]:
        """Every slot, as one copy (a few servers: a few words)."""
        return self._slots.tolist()

    def close(self) -> None:
        self._slots.release()
        self._map.close()

    def __enter__(self) -> ConnectionLoads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AcceptDeferral:
    """The pure rule of the module docstring: defer to a less loaded peer, or race for accept."""

    @staticmethod
    def least_loaded(index: int, loads: Sequence[int]) -> bool:
        """Slot ``index`` is <= every other slot (ties count as least loaded)."""
        own = loads[index]
        return all(own <= load for i, load in enumerate(loads) if i != index)

    @staticmethod
    def defer(index: int, loads: Sequence[int], checks: int) -> bool:
        """Whether server ``index``, having already waited ``checks`` intervals on this wake, waits
        one more ``DEFER_INTERVAL`` (True) or races for accept now (False)."""
        return checks < DEFER_CHECKS and not AcceptDeferral.least_loaded(index, loads)


class AcceptBalance:
    """One API server's side: publishes its connection count and waits its turn to accept.

    Counters (cumulative, for metrics): ``deferrals``, 1 ms waits; ``deferred_accepts``, wakes that
    waited at least once; ``lost_races``, wakes whose first accept found the queue empty (counted by
    the accept loop: a peer took the connection).
    """

    def __init__(self, loads: ConnectionLoads, index: int) -> None:
        if not 0 <= index < loads.count:
            raise ValueError(f"API server index {index} is outside 0..{loads.count - 1}")
        self.loads = loads
        self.index = index
        self.retired = False
        self.deferrals = 0
        self.deferred_accepts = 0
        self.lost_races = 0

    def publish(self, own: int) -> None:
        """Publish this server's open connections (whenever they change); no-op once retired."""
        if not self.retired:
            self.loads.publish(self.index, own)

    def retire(self) -> None:
        """This server accepts no more (drain): peers stop deferring to it."""
        self.retired = True
        self.loads.retire(self.index)

    async def wait_turn(self, own: int) -> None:
        """Called when the listener is readable, before ``accept``: publish ``own`` and wait while
        the rule says defer. Rereads the loads at each check, own slot included, which the server
        republishes as its connections close."""
        self.publish(own)
        checks = 0
        while AcceptDeferral.defer(self.index, self.loads.read(), checks):
            checks += 1
            self.deferrals += 1
            self.deferred_accepts += checks == 1
            await trio.sleep(DEFER_INTERVAL)
