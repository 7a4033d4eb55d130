"""Replica slots: the in-flight table every API server shares, and the least-outstanding-bytes pick.

Dispatch policy ``least-outstanding-bytes`` (issue 14 item 2, design §10): a request goes to the ready
replica with the fewest outstanding request bytes, ties to the least recently assigned, and at most
``cap`` requests (``--max-inflight-per-replica``, default 32) are in flight on a replica *across all API
server processes*. There is no queue: when every ready replica is full ``reserve`` returns None and the
HTTP layer answers 503 at once.

The count has to be shared, so it lives in a small file mapped ``MAP_SHARED`` into every API server
(``create`` by the supervisor before it starts them, ``open`` in each). The file is an array of native
int64s::

    [0:8)                       header: magic, version, api_servers, MAX_REPLICAS, replicas, seq, 0, 0
    [8:8+MAX_REPLICAS)          last_assigned[replica]: the value of seq when it was last picked
    then api_servers * MAX_REPLICAS rows of (in_flight, bytes), server-major

Rules:

- Every change, and every read that decides one, happens under ``fcntl.flock(LOCK_EX)`` on the file,
  so ``reserve`` is check-and-increment atomic across processes: two API servers can never both take
  the last slot of a replica. The critical section is a few dozen memory reads and writes, never I/O,
  so a blocking ``flock`` called from the event loop waits microseconds. The kernel drops the lock of
  a process that dies; a process *stopped* while holding it (SIGSTOP) would stall the others, which
  is why only API servers, never engines or workers, touch the table.
- Each API server writes only its own rows (``api_index``); everyone reads all rows for the totals.
  So when an API server dies, the supervisor zeroes exactly its requests with ``forget_server(i)``
  and no other server's count is disturbed.
- Columns for ``MAX_REPLICAS`` replicas exist from the start, so growing the pool never remaps. The
  header's ``replicas`` (``set_replicas``) is the current count: ``reserve`` picks only below it,
  while ``release`` works on any column, so a retired replica's requests drain normally.
- ``choose`` is the whole policy and pure: fewest outstanding bytes, then the lowest ``last_assigned``
  (never-assigned replicas have 0, so they come first), then the lowest index; only ready replicas
  whose total in-flight count is below ``cap``.
- ``reserve`` either takes a slot and returns a ``Reservation`` or returns None and changes nothing.
  ``release`` is idempotent: it gives back only reservations this object handed out and has not yet
  given back (or forgotten); anything else returns False and changes nothing.
- Counts never go negative and bytes are 0 whenever the in-flight count is 0 (``check_invariants``).
  ``release`` clamps at 0: only a ``forget_server`` of a server that was in fact alive could take a
  row below what its owner still holds, and a clamped row is better than a negative total.
- ``create`` builds the file beside ``path`` and renames it into place, so an ``open`` never sees a
  half-written header, and a process still mapping an older file is never truncated under (SIGBUS).
- One object per thread: ``flock`` belongs to the open file, so two threads sharing one object would
  not exclude each other. (Trio runs one thread; each process opens its own object.)
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

MAX_REPLICAS = 256
MAX_API_SERVERS = 1024
DEFAULT_CAP = 32

MAGIC = int.from_bytes(b"trioslot", "little")  # top byte 't' < 0x80: a positive int64
VERSION = 1

# Header slots (int64 indices).
_H_MAGIC, _H_VERSION, _H_API_SERVERS, _H_MAX_REPLICAS, _H_REPLICAS, _H_SEQ = range(6)
_HEADER_SLOTS = 8
_LAST_BASE = _HEADER_SLOTS
_ROWS_BASE = _LAST_BASE + MAX_REPLICAS
_ITEM = 8  # bytes per slot

# Tokens are unique in the process, so a reservation from one object is never mistaken by another.
_tokens = itertools.count(1)


def _size_bytes(api_servers: int) -> int:
    return _ITEM * (_ROWS_BASE + api_servers * MAX_REPLICAS * 2)


@dataclass(frozen=True, slots=True)
class Reservation:
    """One in-flight slot: ``nbytes`` outstanding on ``replica``, counted in ``api_index``'s row."""

    api_index: int
    replica: int
    nbytes: int
    token: int


def choose(totals: Sequence[tuple[int, int, int]], ready: Sequence[bool], cap: int) -> int | None:
    """The replica to send to: ``totals[i]`` is ``(in_flight, bytes, last_assigned)`` of replica *i*.

    Among the replicas below ``min(len(totals), len(ready))`` that are ready and have fewer than ``cap``
    in flight, the one with the fewest bytes, then the lowest ``last_assigned``, then the lowest index;
    None when there is none.
    """
    best: tuple[int, int, int] | None = None
    for i in range(min(len(totals), len(ready))):
        in_flight, nbytes, last = totals[i]
        if ready[i] and in_flight < cap:
            key = (nbytes, last, i)
            if best is None or key < best:
                best = key
    return None if best is None else best[2]


class ReplicaSlots:
    """The shared table (see the module docstring). Build with ``create`` or ``open``."""

    def __init__(self, mm: mmap.mmap, fd: int | None, path: str | None) -> None:
        # Private: use create/open, which validate the header before this object exists.
        self._mm: mmap.mmap | None = mm
        self._q = memoryview(mm).cast("q")
        self._fd = fd
        self.path = path
        self.api_servers = self._q[_H_API_SERVERS]
        # token -> the reservation this object handed out and has not given back.
        self._live: dict[int, Reservation] = {}

    # -------------------------------------------------------------------------------- construction

    @classmethod
    def create(cls, path: str | None, api_servers: int, replicas: int) -> ReplicaSlots:
        """A fresh, zeroed table for ``api_servers`` API servers and ``replicas`` replicas.

        With a ``path`` the file is (re)created there, replacing any old one; with None the table is an
        anonymous shared mapping (one process, or children forked after this call).
        """
        if not 1 <= api_servers <= MAX_API_SERVERS:
            raise ValueError(f"api_servers must be in 1..{MAX_API_SERVERS}, got {api_servers}")
        if not 1 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in 1..{MAX_REPLICAS}, got {replicas}")
        size = _size_bytes(api_servers)
        if path is None:
            mm = mmap.mmap(-1, size)  # anonymous mappings are MAP_SHARED and zero-filled
            _init_header(mm, api_servers, replicas)
            return cls(mm, None, None)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
        try:
            os.ftruncate(fd, size)  # zero-filled
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _init_header(mm, api_servers, replicas)
            mm.flush()
            os.replace(tmp, path)  # atomic: an open sees the old file or this one, whole
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        return cls(mm, fd, path)

    @classmethod
    def open(cls, path: str, *, api_servers: int | None = None) -> ReplicaSlots:
        """Map an existing table. ValueError when the file is not one (magic, version, size, dims) or
        its API server count differs from ``api_servers`` (when given)."""
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                size = os.fstat(fd).st_size
                if size < _ITEM * _ROWS_BASE:
                    raise ValueError(f"{path}: {size} bytes is too short for a replica slot table")
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                try:
                    _validate(memoryview(mm).cast("q"), size, api_servers, path)
                except BaseException:
                    mm.close()
                    raise
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, fd, path)

    def close(self) -> None:
        """Unmap and close; idempotent. The table itself (the file) stays."""
        if self._mm is None:
            return
        self._q.release()  # the mmap cannot close while a view exports its buffer
        self._mm.close()
        self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ReplicaSlots:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- dispatch

    def reserve(self, api_index: int, ready: Sequence[bool], cap: int, nbytes: int) -> Reservation | None:
        """Take a slot on the replica ``choose`` picks (``ready[i]`` for replica *i*; only replicas
        below the current count count), counted in ``api_index``'s row, or None (nothing changed)."""
        self._check_server(api_index)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        q = self._q
        with self._locked():
            replica = choose(self._all_totals_unlocked(), ready, cap)
            if replica is None:
                return None
            row = _row(api_index, replica)
            q[row] += 1
            q[row + 1] += nbytes
            q[_H_SEQ] += 1
            q[_LAST_BASE + replica] = q[_H_SEQ]
        res = Reservation(api_index, replica, nbytes, next(_tokens))
        self._live[res.token] = res
        return res

    def release(self, res: Reservation) -> bool:
        """Give a slot back. False (and nothing changed) unless this object handed ``res`` out and has
        not given it back or forgotten its server since."""
        if self._live.get(res.token) != res:
            return False
        q = self._q
        row = _row(res.api_index, res.replica)
        with self._locked():
            in_flight = max(0, q[row] - 1)
            q[row] = in_flight
            # Bytes go with the last request: a clamped row must not keep bytes without requests.
            q[row + 1] = max(0, q[row + 1] - res.nbytes) if in_flight else 0
        del self._live[res.token]  # after the write: a release on a closed table raises, keeps it
        return True

    def forget_server(self, api_index: int) -> None:
        """Zero every row of API server ``api_index`` (it died: its requests are gone). Reservations of
        that server held by this object can no longer be released."""
        self._check_server(api_index)
        base = _row(api_index, 0)
        with self._locked():
            self._q[base : base + 2 * MAX_REPLICAS] = memoryview(bytes(_ITEM * 2 * MAX_REPLICAS)).cast("q")
        self._live = {t: r for t, r in self._live.items() if r.api_index != api_index}

    def set_replicas(self, n: int) -> None:
        """Make ``n`` the current replica count (``reserve`` picks only below it)."""
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"replicas must be in 1..{MAX_REPLICAS}, got {n}")
        with self._locked():
            self._q[_H_REPLICAS] = n

    # -------------------------------------------------------------------------------------- reads

    @property
    def replicas(self) -> int:
        """The current replica count (the header's)."""
        return self._q[_H_REPLICAS]

    def totals(self, replica: int) -> tuple[int, int]:
        """(in-flight requests, outstanding bytes) on ``replica`` across all API servers."""
        self._check_replica(replica)
        with self._locked(shared=True):
            return self._totals_unlocked(replica)

    def all_totals(self) -> list[tuple[int, int, int]]:
        """(in-flight, bytes, last_assigned) of every replica below the current count, read at once:
        what ``choose`` sees (and what an inventory reports)."""
        with self._locked(shared=True):
            return self._all_totals_unlocked()

    def last_assigned(self, replica: int) -> int:
        """The sequence number of the last reservation on ``replica`` (0: never assigned)."""
        self._check_replica(replica)
        return self._q[_LAST_BASE + replica]

    def full(self, replica: int, cap: int) -> bool:
        """Whether ``replica`` has ``cap`` or more requests in flight across all API servers."""
        return self.totals(replica)[0] >= cap

    def any_usable(self, ready: Sequence[bool], cap: int) -> bool:
        """Whether ``reserve`` with these arguments would find a replica (at this instant)."""
        return choose(self.all_totals(), ready, cap) is not None

    def check_invariants(self) -> None:
        q = self._q
        with self._locked(shared=True):
            assert q[_H_MAGIC] == MAGIC and q[_H_VERSION] == VERSION
            assert 1 <= q[_H_REPLICAS] <= MAX_REPLICAS, q[_H_REPLICAS]
            seq = q[_H_SEQ]
            assert seq >= 0
            for r in range(MAX_REPLICAS):
                assert 0 <= q[_LAST_BASE + r] <= seq, (r, q[_LAST_BASE + r], seq)
            for s in range(self.api_servers):
                for r in range(MAX_REPLICAS):
                    in_flight, nbytes = q[_row(s, r)], q[_row(s, r) + 1]
                    assert in_flight >= 0 and nbytes >= 0, (s, r, in_flight, nbytes)
                    assert in_flight > 0 or nbytes == 0, (s, r, in_flight, nbytes)
        for res in self._live.values():
            assert 0 <= res.api_index < self.api_servers and 0 <= res.replica < MAX_REPLICAS, res

    # ---------------------------------------------------------------------------------- internals

    @contextmanager
    def _locked(self, *, shared: bool = False) -> Iterator[None]:
        if self._mm is None:
            raise ValueError("replica slot table is closed")
        if self._fd is None:  # anonymous: one process, and nothing here awaits, so nothing interleaves
            yield
            return
        fcntl.flock(self._fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _totals_unlocked(self, replica: int) -> tuple[int, int]:
        q = self._q
        in_flight = nbytes = 0
        for s in range(self.api_servers):
            row = _row(s, replica)
            in_flight += q[row]
            nbytes += q[row + 1]
        return in_flight, nbytes

    def _all_totals_unlocked(self) -> list[tuple[int, int, int]]:
        q = self._q
        n = q[_H_REPLICAS]
        in_flight = [0] * n
        nbytes = [0] * n
        for s in range(self.api_servers):
            base = _row(s, 0)
            # One slice per server: rows are (in_flight, bytes) pairs, so even slots and odd slots.
            pairs = q[base : base + 2 * n].tolist()
            for r in range(n):
                in_flight[r] += pairs[2 * r]
                nbytes[r] += pairs[2 * r + 1]
        return [(in_flight[r], nbytes[r], q[_LAST_BASE + r]) for r in range(n)]

    def _check_server(self, api_index: int) -> None:
        if not 0 <= api_index < self.api_servers:
            raise ValueError(f"api_index must be in 0..{self.api_servers - 1}, got {api_index}")

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < MAX_REPLICAS:
            raise ValueError(f"replica must be in 0..{MAX_REPLICAS - 1}, got {replica}")


def _row(api_index: int, replica: int) -> int:
    """Slot index of ``(in_flight, bytes)`` for one (API server, replica)."""
    return _ROWS_BASE + 2 * (api_index * MAX_REPLICAS + replica)


def _init_header(mm: mmap.mmap, api_servers: int, replicas: int) -> None:
    q = memoryview(mm).cast("q")
    try:
        q[_H_VERSION] = VERSION
        q[_H_API_SERVERS] = api_servers
        q[_H_MAX_REPLICAS] = MAX_REPLICAS
        q[_H_REPLICAS] = replicas
        q[_H_SEQ] = 0
        q[_H_MAGIC] = MAGIC  # last: a header with the magic is a whole header
    finally:
        q.release()


def _validate(q: memoryview, size: int, api_servers: int | None, path: str) -> None:
    try:
        if q[_H_MAGIC] != MAGIC:
            raise ValueError(f"{path}: not a replica slot table (bad magic)")
        if q[_H_VERSION] != VERSION:
            raise ValueError(f"{path}: table version {q[_H_VERSION]}, this build reads {VERSION}")
        if q[_H_MAX_REPLICAS] != MAX_REPLICAS:
            raise ValueError(
                f"{path}: table has {q[_H_MAX_REPLICAS]} replica columns, expected {MAX_REPLICAS}"
            )
        found = q[_H_API_SERVERS]
        if not 1 <= found <= MAX_API_SERVERS or size != _size_bytes(found):
            raise ValueError(f"{path}: header says {found} API servers, which does not fit {size} bytes")
        if api_servers is not None and found != api_servers:
            raise ValueError(f"{path}: table is for {found} API servers, expected {api_servers}")
        if not 1 <= q[_H_REPLICAS] <= MAX_REPLICAS:
            raise ValueError(f"{path}: header says {q[_H_REPLICAS]} replicas, outside 1..{MAX_REPLICAS}")
    finally:
        q.release()
