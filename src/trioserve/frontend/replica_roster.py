"""Which replicas a client may send to, while the deployment is resized (docs/replicas.md).

A tree is sized at start for ``capacity`` ranks (``--max-data-parallel-size``); the replicas wanted
now are ranks ``0 .. desired - 1``. The supervisor changes ``desired`` on a config reload and tells
every client (``ReplicaRoster``); a restarted client is started with the current value.

Rules:

- **wanted**: a rank below ``desired``. Only wanted ranks take new requests: a rank that is not
  wanted is never dispatchable, even when nothing else is up (it is on its way out; serving it more
  work would delay that forever).
- **draining**: a rank that is not wanted and has joined this client. This client owes it one
  ``ClientDone``, sent after every add it already placed there (``done_due``): the engine retires
  once each of its clients has said it and nothing is left running.
- A rank that becomes wanted again is owed nothing (its new engine joins as any other).
- **retired**: the engine said ``EngineRetired``; it owes and is owed nothing, and is no longer shown.
- ``desired`` is between 1 and ``capacity``: one replica is always wanted.

Pure: no I/O and no clock; the engine client is its shell.
"""

from __future__ import annotations

from collections.abc import Collection


class Roster:
    __slots__ = ("_owed", "capacity", "desired")

    def __init__(self, capacity: int, desired: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"need capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.desired = capacity
        self._owed: set[int] = set()  # draining ranks this client still owes ClientDone
        if desired is not None:
            self.resize(desired, ())

    def wanted(self, rank: int) -> bool:
        return 0 <= rank < self.desired

    def resize(self, desired: int, joined: Collection[int]) -> list[int]:
        """Want ranks ``0 .. desired - 1`` (clamped to 1 .. capacity); ``joined``: the ranks that
        joined this client. Returns the joined ranks that begin draining now."""
        desired = max(1, min(desired, self.capacity))
        self.desired = desired
        self._owed = {rank for rank in self._owed if rank >= desired}
        draining = sorted(rank for rank in joined if rank >= desired and rank not in self._owed)
        self._owed.update(draining)
        return draining

    def joined(self, rank: int) -> None:
        """``rank``'s engine joined (or joined again): one that is not wanted is owed ClientDone."""
        if not self.wanted(rank):
            self._owed.add(rank)

    def retired(self, rank: int) -> None:
        self._owed.discard(rank)

    def owes(self, rank: int) -> bool:
        return rank in self._owed

    def done_due(self, reachable: Collection[int], placed: Collection[int]) -> int | None:
        """A rank to send ``ClientDone`` now, which counts as sent: owed, ``reachable`` (joined, not
        dead), and holding no add still queued for it (``placed``: the ranks of the adds reserved at
        admission and not sent yet). None: none is due."""
        for rank in sorted(self._owed):
            if rank in reachable and rank not in placed:
                self._owed.discard(rank)
                return rank
        return None

    def check_invariants(self) -> None:
        assert 1 <= self.desired <= self.capacity
        assert all(self.desired <= rank < self.capacity for rank in self._owed)
