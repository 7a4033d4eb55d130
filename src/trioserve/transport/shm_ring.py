"""A single-writer, many-reader ring of fixed-size slots in shared memory (design §8).

The engine core puts each step's ``SchedulerOutput`` on one of these for its workers; the same class with
one reader carries results back from the output rank. Payloads are opaque bytes (the caller encodes
msgspec frames); the ring adds a sequence number and a length, nothing else.

Segment layout (native byte order, every field naturally aligned, every area on its own 64-byte line)::

    header    magic u64 | num_slots u32 | slot_size u32 | num_readers u32 | writer pid u32
              | writer state u32 | flags u32 | writer wants u64
    reader i  ack u64 | wants u64 | pid u32 | state u32
    slot k    seq u64 | length u32 | pad u32 | payload[slot_size]           (stride rounded up to 64)

Rules:

1. Message ``n`` (1, 2, 3, ...) lives in slot ``(n - 1) % num_slots``; a slot's ``seq`` is the number of
   the message in it, 0 before its first use.
2. Every word has exactly one writing endpoint: the geometry is written by the creator before anyone
   attaches, the slots and the writer fields by the writer, reader ``i``'s line by reader ``i`` (the
   creator's ``close()`` also marks endpoints that never attached GONE). No word is read-modified-written
   by two processes, so no lock is needed.
3. Reader ``i``'s ``ack`` is the number of the last message it has copied out. The writer publishes
   message ``n`` only when ``n - ack_i <= num_slots`` for every live reader (attached, or pending: not
   attached yet), so a slot is never overwritten while a live reader may still read it; when the ring is
   full the writer waits. A reader that closed (state GONE) stops holding the writer back.
4. A reader that wants message ``m`` finds in its slot either ``m`` (ready) or the previous occupant
   ``m - num_slots`` (0 on the first lap): not written yet. Anything else, an ack beyond what was
   written, a length above ``slot_size``, an unknown state or a header that does not match the handle is
   ``CorruptRing``: nothing read from the segment is used as an offset or a length before it is checked.

Memory ordering. This relies on x86-64's total store order: stores become visible in program order, loads
are not reordered with loads, stores are not reordered with earlier loads; only a load may pass an earlier
store. Fields are read and written through ``memoryview.cast("Q")``/``("I")`` items, an aligned memcpy of
8 or 4 bytes that compiles to one ``mov`` (atomic when aligned); ``struct``'s little-endian codes would
go byte by byte and could show a torn sequence number.

- Publish: the writer copies the payload, stores the length, then stores ``seq``. A reader loads ``seq``
  first and the length and payload after, so ``seq == m`` implies it sees all of message ``m``.
- Reuse: a reader copies the payload out, then stores its ack; the writer loads the ack before it stores
  into the slot again, so the copy never sees the next message's bytes.
- Sleeping is a Dekker pattern: the waiter stores what it waits for (its ``wants`` word), then loads
  the condition (``seq``, or the acks); the other side stores the condition, then loads ``wants``. TSO
  lets each load pass the store before it, so both could miss and the waiter would sleep through a
  message. Both sides therefore put a full barrier between that store and that load: acquiring and
  releasing a ``threading.Lock``, which CPython on Linux implements with glibc semaphores whose fast path
  is a ``lock cmpxchg`` (a full barrier on x86). As a backstop, no sleep lasts longer than
  ``RECHECK_INTERVAL`` without looking at the shared memory again: a lost wakeup would cost latency,
  never a hang.

Other architectures (ARM) reorder stores too and would need real barriers, which CPython does not expose;
the ring refuses to start there.

Doorbells are OS pipes, two per reader: a data pipe (writer -> reader ``i``) and an ack pipe (reader
``i`` -> writer). A byte means "look again", never "one message": the woken side drains the pipe and
re-reads the shared memory. A side rings only when the other side sleeps for exactly the value it just
stored: the writer, after publishing message ``n``, rings reader ``i`` if ``wants_i == n``; a reader,
after acknowledging ``m``, rings the writer if the writer ``wants`` ack ``m`` (the ack its next slot needs
from the slowest reader). So a busy pipeline makes no system calls, and a sleeper gets at most one
ring from each peer. A sleeping sync process blocks in ``poll`` with a timeout; a Trio task awaits
``trio.lowlevel.wait_readable`` on the same fd.

Liveness. After a handoff every pipe end lives in exactly one process, so end-of-file on a pipe means the
process on the other side is gone: EOF on ack pipe ``i`` while reader ``i`` has not closed raises
``ReaderDied(i)`` in a waiting writer (and a doorbell rung at a dead reader raises it too); EOF on the data
pipe, once the messages already published are read, raises ``WriterClosed`` when the writer closed and
``WriterDied`` when it did not.

Processes. ``ShmRing`` creates the segment and the pipes. Endpoints in the creator's process come from
``ring.writer()`` / ``ring.reader(i)``; an endpoint for a subprocess comes from ``ring.handoff_writer()``
/ ``ring.handoff_reader(i)``, a context manager yielding a ``RingHandle`` (JSON for the command line, its
``fds`` for ``Popen(pass_fds=...)``) that closes the creator's copies of those fds when it exits. The
child calls ``RingReader.attach(handle)`` (or ``RingWriter.attach``), which maps the segment without
registering it with multiprocessing's resource tracker: only the creator tracks and unlinks it (and its
tracker unlinks it if the creator is killed).

Rule 5 (``ShmRing(..., unlink_when_attached=True)``, a flag in the header): the segment's name is
unlinked as soon as every endpoint has attached, by whichever endpoint attaches last (each one, after
storing ATTACHED, puts a full barrier before it loads the others' states, so of two that attach at once
at least one sees both). The mappings stay valid; the kernel frees the memory with the last of them. From
then on no kill of any process, in any order, leaves the segment behind; only the start-up window before
the last attach relies on the creator (``close``) and its tracker. The creator's tracker entry goes
exactly once: in ``release_tracking()`` (once the name is gone, so that a killed creator's tracker does
not warn about a segment that no longer exists) or else in ``close``.

Each endpoint is used by one thread or one Trio task at a time.
"""

from __future__ import annotations

import os
import platform
import secrets
import select
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import Literal, Self

import msgspec
import trio

RECHECK_INTERVAL = 0.25  # seconds a sleeper waits on its doorbell before looking at the memory anyway

MAGIC = int.from_bytes(b"tsring01", "little")
LINE = 64
HEADER_SIZE = LINE
READER_AREA = LINE
SLOT_HEADER = 16
MAX_SLOT_SIZE = 2**32 - 1 - LINE  # the length is a u32
MAX_READERS = 256

# Byte offsets of the fields. Header:
_H_MAGIC = 0  # u64
_H_NUM_SLOTS = 8  # u32
_H_SLOT_SIZE = 12  # u32
_H_NUM_READERS = 16  # u32
_H_WRITER_PID = 20  # u32
_H_WRITER_STATE = 24  # u32
_H_FLAGS = 28  # u32: the creator's options, written before anyone attaches
_H_WRITER_WANTS = 32  # u64: the ack the writer sleeps for, 0 when it is not sleeping
# Within reader i's line:
_R_ACK = 0  # u64
_R_WANTS = 8  # u64: the message the reader sleeps for, 0 when it is not sleeping
_R_PID = 16  # u32
_R_STATE = 20  # u32
# Within a slot:
_S_SEQ = 0  # u64
_S_LENGTH = 8  # u32

FLAG_UNLINK_WHEN_ATTACHED = 1  # rule 5

# Endpoint states (writer state and reader state).
PENDING, ATTACHED, GONE = 0, 1, 2
_STATES = (PENDING, ATTACHED, GONE)

_TSO_MACHINES = frozenset({"x86_64", "amd64"})


# --------------------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------------------


class ShmRingError(Exception):
    """Base class of the ring's errors."""


class MessageTooLarge(ShmRingError):
    def __init__(self, size: int, capacity: int) -> None:
        super().__init__(f"message of {size} bytes does not fit a ring slot of {capacity} bytes")
        self.size = size
        self.capacity = capacity


class CorruptRing(ShmRingError):
    """Something read from the shared segment breaks the ring's rules."""


class ReaderDied(ShmRingError):
    def __init__(self, reader_index: int, pid: int = 0) -> None:
        who = f"pid {pid}" if pid else "before it attached"
        super().__init__(f"ring reader {reader_index} died ({who})")
        self.reader_index = reader_index
        self.pid = pid


class WriterDied(ShmRingError):
    """The writer's process is gone without closing the ring (every message it published was read)."""


class WriterClosed(ShmRingError):
    """The writer closed the ring and this reader has read every message it published."""


class RingClosed(ShmRingError):
    """This endpoint (or the ring that owned it) was closed."""


# --------------------------------------------------------------------------------------------------
# The pure core: geometry and the rules on values read from the segment. No I/O.
# --------------------------------------------------------------------------------------------------


def _align(n: int) -> int:
    return (n + LINE - 1) // LINE * LINE


@dataclass(frozen=True, slots=True)
class RingGeometry:
    num_slots: int
    slot_size: int  # payload capacity of one slot, in bytes
    num_readers: int

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {self.num_slots}")
        if not 1 <= self.slot_size <= MAX_SLOT_SIZE:
            raise ValueError(f"slot_size must be in 1..{MAX_SLOT_SIZE}, got {self.slot_size}")
        if not 1 <= self.num_readers <= MAX_READERS:
            raise ValueError(f"num_readers must be in 1..{MAX_READERS}, got {self.num_readers}")

    @property
    def slot_stride(self) -> int:
        return _align(SLOT_HEADER + self.slot_size)

    @property
    def slots_offset(self) -> int:
        return HEADER_SIZE + READER_AREA * self.num_readers

    @property
    def size(self) -> int:
        """Bytes of the whole segment."""
        return self.slots_offset + self.num_slots * self.slot_stride

    def reader_offset(self, index: int) -> int:
        if not 0 <= index < self.num_readers:
            raise IndexError(f"reader index {index} out of range 0..{self.num_readers - 1}")
        return HEADER_SIZE + READER_AREA * index

    def slot_offset(self, seq: int) -> int:
        """Where message ``seq`` (1-based) lives."""
        if seq < 1:
            raise ValueError(f"message numbers start at 1, got {seq}")
        return self.slots_offset + (seq - 1) % self.num_slots * self.slot_stride


def slot_holds(seen: int, wanted: int, num_slots: int) -> bool:
    """Whether a slot whose ``seq`` reads ``seen`` holds message ``wanted`` (rule 4).

    False: the slot still holds the message one lap earlier (or nothing yet), so ``wanted`` is not
    published. Any other value can only come from corruption (or a writer breaking rule 3).
    """
    if seen == wanted:
        return True
    if seen == max(wanted - num_slots, 0):
        return False
    raise CorruptRing(
        f"slot for message {wanted} holds sequence number {seen}; "
        f"expected {wanted} or {max(wanted - num_slots, 0)}"
    )


def check_length(length: int, capacity: int) -> int:
    if length > capacity:
        raise CorruptRing(f"slot length {length} exceeds the slot size {capacity}")
    return length


def writable_until(acks: Sequence[int], written: int, num_slots: int) -> int:
    """The last message number the writer may publish given the live readers' acks (rule 3).

    With no live reader nothing holds the writer back.
    """
    lowest = written
    for ack in acks:
        if not 0 <= ack <= written:
            raise CorruptRing(f"a reader acknowledged message {ack} but {written} were written")
        lowest = min(lowest, ack)
    return lowest + num_slots if acks else 2**64 - 1


# --------------------------------------------------------------------------------------------------
# The handle a subprocess attaches with.
# --------------------------------------------------------------------------------------------------


class RingHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a subprocess needs to attach one endpoint: pass ``to_json()`` on its command line and
    ``fds`` in ``Popen(pass_fds=...)`` (the fd numbers stay the same in the child)."""

    name: str  # the shared-memory segment, without the leading slash
    num_slots: int
    slot_size: int
    num_readers: int
    role: Literal["writer", "reader"]
    reader_index: int  # -1 for the writer
    data_fds: tuple[int, ...]  # writer: the write end of every data pipe; reader: its read end
    ack_fds: tuple[int, ...]  # writer: the read end of every ack pipe; reader: its write end

    @property
    def fds(self) -> tuple[int, ...]:
        return (*self.data_fds, *self.ack_fds)

    @property
    def geometry(self) -> RingGeometry:
        return RingGeometry(self.num_slots, self.slot_size, self.num_readers)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> RingHandle:
        return msgspec.json.decode(text, type=cls)


# --------------------------------------------------------------------------------------------------
# Small I/O helpers.
# --------------------------------------------------------------------------------------------------

_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release


def _full_fence() -> None:
    """A full memory barrier on x86 (see the module docstring): a locked instruction inside glibc."""
    _fence_acquire()
    _fence_release()


def _check_platform() -> None:
    machine = platform.machine().lower()
    if machine not in _TSO_MACHINES:
        raise NotImplementedError(
            f"the shared-memory ring relies on x86-64 store ordering; {machine!r} is not supported"
        )


def _drain(fd: int) -> bool:
    """Empty a doorbell pipe; True when every write end is closed (end of file).

    A short read ends it without a second call: a byte that lands after it only makes the next wait
    return at once, and the end of file then shows on the next drain.
    """
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return False
        if len(chunk) < 4096:
            return not chunk


def _close_fd(fd: int) -> None:
    with suppress(RuntimeError):  # RuntimeError: not inside trio.run
        trio.lowlevel.notify_closing(fd)  # wakes a task of ours parked on it with ClosedResourceError
    os.close(fd)


def _adopt_fds(fds: Sequence[int]) -> None:
    """Make fds received through ``pass_fds`` private to this process again, and non-blocking."""
    for fd in fds:
        try:
            os.set_inheritable(fd, False)
            os.set_blocking(fd, False)
        except OSError as exc:
            raise RingClosed(
                f"fd {fd} from the ring handle is not open in this process "
                "(pass handle.fds to subprocess.Popen(pass_fds=...))"
            ) from exc


def _skip_register(name: object, rtype: str) -> None:
    pass


_attach_lock = threading.Lock()


def _attach_segment(name: str) -> SharedMemory:
    """Map an existing segment without registering it with this process's resource tracker.

    On Python 3.11 ``SharedMemory(name)`` registers every attach; the tracker then warns about a leak
    and unlinks the creator's segment when this process exits (3.13 added ``track=False``). Registering
    and unregistering after the fact would start a tracker process per attaching process and leave a
    window where a kill unlinks the segment, so registration is switched off for this one call.
    """
    with _attach_lock:
        register = resource_tracker.register
        resource_tracker.register = _skip_register
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _all_attached(u32: memoryview, geometry: RingGeometry) -> bool:
    """No endpoint is PENDING: every one attached (or never will: closed, or given up by ``close``)."""
    offsets = (_H_WRITER_STATE, *(geometry.reader_offset(i) + _R_STATE for i in range(geometry.num_readers)))
    return all(u32[offset // 4] != PENDING for offset in offsets)


def _unlink_untracked(shm: SharedMemory) -> None:
    """Unlink the segment's name without telling this process's resource tracker (rule 5: an attached
    process has no tracker entry for it; the creator's goes in ``release_tracking`` or ``close``)."""
    with _attach_lock:
        unregister = resource_tracker.unregister
        resource_tracker.unregister = _skip_register
        try:
            with suppress(FileNotFoundError):  # another endpoint was as quick (see rule 5)
                shm.unlink()
        finally:
            resource_tracker.unregister = unregister


def _view(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:
        raise RingClosed(f"segment {shm.name} is unmapped")
    return buf


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _slice(deadline: float | None) -> float:
    """Seconds to sleep next: at most RECHECK_INTERVAL; TimeoutError once the deadline has passed."""
    if deadline is None:
        return RECHECK_INTERVAL
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("timed out waiting on the shared-memory ring")
    return min(remaining, RECHECK_INTERVAL)


def _poll_ms(seconds: float) -> int:
    return max(1, int(seconds * 1000 + 0.999))


async def _wait_any_readable(fds: Sequence[int]) -> None:
    if len(fds) == 1:
        await trio.lowlevel.wait_readable(fds[0])
        return

    async def wait_one(fd: int) -> None:
        await trio.lowlevel.wait_readable(fd)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for fd in fds:
            nursery.start_soon(wait_one, fd)


# --------------------------------------------------------------------------------------------------
# Endpoints.
# --------------------------------------------------------------------------------------------------


class _Endpoint:
    """Views of the segment plus the endpoint's own fds. ``owns_mapping``: the endpoint mapped the
    segment itself (attached from a handle) and unmaps it on close; otherwise it borrows the creator's."""

    def __init__(self, geometry: RingGeometry, shm: SharedMemory, *, owns_mapping: bool) -> None:
        self.geometry = geometry
        self._shm = shm
        self._owns_mapping = owns_mapping
        buf = _view(shm)
        self._buf = buf  # the mapping's own view: slices of it are temporaries, released at once
        self._u64 = buf.cast("Q")  # aligned 8-byte loads and stores (see "Memory ordering")
        self._u32 = buf.cast("I")
        self._capacity = geometry.slot_size
        self._num_slots = geometry.num_slots
        self._stride = geometry.slot_stride
        self._slots_offset = geometry.slots_offset
        self.closed = False

    @staticmethod
    def _open_segment(handle: RingHandle) -> SharedMemory:
        _check_platform()
        geometry = handle.geometry
        shm = _attach_segment(handle.name)
        try:
            if shm.size < geometry.size:
                raise CorruptRing(
                    f"segment {handle.name} has {shm.size} bytes, the handle needs {geometry.size}"
                )
            u64 = _view(shm).cast("Q")
            u32 = _view(shm).cast("I")
            try:
                found = (
                    u64[_H_MAGIC // 8],
                    u32[_H_NUM_SLOTS // 4],
                    u32[_H_SLOT_SIZE // 4],
                    u32[_H_NUM_READERS // 4],
                )
            finally:
                u64.release()
                u32.release()
            wanted = (MAGIC, geometry.num_slots, geometry.slot_size, geometry.num_readers)
            if found != wanted:
                raise CorruptRing(
                    f"segment {handle.name} header (magic, slots, slot size, readers) is {found}, "
                    f"the handle says {wanted}"
                )
        except BaseException:
            shm.close()
            raise
        return shm

    def _state(self, offset: int) -> int:
        state = self._u32[offset // 4]
        if state not in _STATES:
            raise CorruptRing(f"unknown endpoint state {state} at offset {offset}")
        return state

    def _claim(self, state_offset: int, pid_offset: int, what: str) -> None:
        if self._state(state_offset) != PENDING:
            raise RingClosed(f"{what} of ring {self._shm.name} is already attached or closed")
        self._u32[pid_offset // 4] = os.getpid()
        self._u32[state_offset // 4] = ATTACHED
        if self._u32[_H_FLAGS // 4] & FLAG_UNLINK_WHEN_ATTACHED:
            _full_fence()  # our ATTACHED store before the loads of the other states (rule 5)
            if _all_attached(self._u32, self.geometry):
                _unlink_untracked(self._shm)

    def _check_open(self) -> None:
        if self.closed:
            raise RingClosed("ring endpoint is closed")

    def _release_mapping(self) -> None:
        self._u64.release()
        self._u32.release()
        if self._owns_mapping:
            self._shm.close()

    def __del__(self) -> None:
        # Dropped without close() (say at interpreter exit): unmap in the order the mapping needs, views
        # first, or SharedMemory.__del__ complains. Not a close: the state stays ATTACHED, so the other
        # side sees this process's exit as a death, not a detach.
        if not getattr(self, "closed", True):
            with suppress(Exception):
                self._release_mapping()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class RingWriter(_Endpoint):
    """The ring's one writer."""

    def __init__(
        self,
        geometry: RingGeometry,
        shm: SharedMemory,
        data_fds: Sequence[int],
        ack_fds: Sequence[int],
        *,
        owns_mapping: bool,
    ) -> None:
        super().__init__(geometry, shm, owns_mapping=owns_mapping)
        try:
            self._claim(_H_WRITER_STATE, _H_WRITER_PID, "the writer")
        except BaseException:
            self._release_mapping()
            raise
        self._data_fds = list(data_fds)
        self._ack_fds = list(ack_fds)
        self._written = 0  # messages published
        self._limit = 0  # the last message number known to be writable without looking at the acks
        self._acks = [0] * geometry.num_readers
        self._live: list[int] = list(range(geometry.num_readers))
        # (wants word index, data fd, reader index) of the live readers, for the doorbells.
        self._bells: list[tuple[int, int, int]] = []
        self._poller = select.poll()
        self._rebuild_live()
        for i in self._live:
            self._poller.register(self._ack_fds[i], select.POLLIN)

    @classmethod
    def attach(cls, handle: RingHandle | str) -> RingWriter:
        """The writer endpoint in the process the handle was passed to."""
        if isinstance(handle, str):
            handle = RingHandle.from_json(handle)
        if handle.role != "writer":
            raise ValueError(f"a {handle.role} handle cannot attach a writer")
        _adopt_fds(handle.fds)
        try:
            shm = cls._open_segment(handle)
            return cls(handle.geometry, shm, handle.data_fds, handle.ack_fds, owns_mapping=True)
        except BaseException:
            for fd in handle.fds:
                os.close(fd)
            raise

    @property
    def written(self) -> int:
        """How many messages this writer has published."""
        return self._written

    def _rebuild_live(self) -> None:
        self._bells = [
            ((self.geometry.reader_offset(i) + _R_WANTS) // 8, self._data_fds[i], i) for i in self._live
        ]

    def _drop(self, index: int) -> None:
        """Reader ``index`` closed: it no longer holds the writer back or gets doorbells."""
        if index in self._live:
            self._live.remove(index)
            self._poller.unregister(self._ack_fds[index])
            self._rebuild_live()

    def _reader_gone(self, index: int) -> None:
        """Reader ``index``'s pipe ends are closed: drop it if it closed, else it died."""
        offset = self.geometry.reader_offset(index)
        if self._state(offset + _R_STATE) != GONE:
            raise ReaderDied(index, self._u32[(offset + _R_PID) // 4])
        self._drop(index)

    def _refresh_limit(self) -> None:
        acks = []
        for i in list(self._live):
            offset = self.geometry.reader_offset(i)
            if self._state(offset + _R_STATE) == GONE:
                self._drop(i)
                continue
            ack = self._u64[(offset + _R_ACK) // 8]
            if ack < self._acks[i]:
                raise CorruptRing(f"reader {i}'s ack went back from {self._acks[i]} to {ack}")
            self._acks[i] = ack
            acks.append(ack)
        self._limit = writable_until(acks, self._written, self._num_slots)

    def try_write(self, payload: bytes | bytearray | memoryview) -> bool:
        """Publish one message if a slot is free; False when the ring is full. Never blocks.

        ``ReaderDied`` may come after the message was published (a doorbell found its reader dead).
        """
        if self.closed:
            raise RingClosed("ring writer is closed")
        size = len(payload)
        if size > self._capacity:
            raise MessageTooLarge(size, self._capacity)
        seq = self._written + 1
        if seq > self._limit:
            self._refresh_limit()
            if seq > self._limit:
                return False
        offset = self._slots_offset + (seq - 1) % self._num_slots * self._stride
        start = offset + SLOT_HEADER
        u64 = self._u64
        self._buf[start : start + size] = payload
        self._u32[(offset + _S_LENGTH) >> 2] = size
        u64[offset >> 3] = seq  # publish: after the payload and the length
        self._written = seq
        _fence_acquire()  # a full barrier: the seq store before the wants loads (Dekker)
        _fence_release()
        for word, fd, index in self._bells:
            if u64[word] == seq:
                self._ring(fd, index)
        return True

    def _ring(self, fd: int, index: int) -> None:
        try:
            os.write(fd, b"\x01")
        except BlockingIOError:
            pass  # the pipe is full of wakeups already
        except BrokenPipeError:
            self._reader_gone(index)

    def _service_acks(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for an ack doorbell; drain what rang; EOF -> closed or died."""
        for fd, _ in self._poller.poll(_poll_ms(timeout_s) if timeout_s > 0 else 0):
            if _drain(fd):
                self._reader_gone(self._ack_fds.index(fd))

    def check_readers(self) -> None:
        """Raise ``ReaderDied`` now if a reader's process is gone (one ``poll`` call, no waiting)."""
        self._check_open()
        self._service_acks(0)

    def _sleep_for(self, ack: int) -> None:
        """Before sleeping: ask the readers to ring when one acknowledges ``ack`` (0: stop asking)."""
        self._u64[_H_WRITER_WANTS // 8] = ack
        if ack:
            _full_fence()  # the wants store before the ack loads (Dekker)

    def write_blocking(self, payload: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish one message, waiting while the ring is full; TimeoutError after ``timeout`` s."""
        if self.try_write(payload):
            return
        deadline = _deadline(timeout)
        self._sleep_for(self._written + 1 - self._num_slots)
        try:
            while not self.try_write(payload):
                self._service_acks(_slice(deadline))
        finally:
            if not self.closed:
                self._sleep_for(0)

    async def write(self, payload: bytes | bytearray | memoryview) -> None:
        """Publish one message, waiting while the ring is full.

        Like ``TrioZmqSocket.send_multipart`` this is always a cancellation point but a schedule point
        only when it waits: a loop that never fills the ring needs another checkpoint.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.try_write(payload):
            return
        self._sleep_for(self._written + 1 - self._num_slots)
        try:
            while not self.try_write(payload):
                with trio.move_on_after(RECHECK_INTERVAL):
                    await _wait_any_readable([self._ack_fds[i] for i in self._live])
                self._service_acks(0)
        finally:
            if not self.closed:
                self._sleep_for(0)

    def close(self) -> None:
        """Mark the writer closed (readers finish what was published, then get ``WriterClosed``)."""
        if self.closed:
            return
        self.closed = True
        self._u64[_H_WRITER_WANTS // 8] = 0
        self._u32[_H_WRITER_STATE // 4] = GONE  # before the fds close: a reader seeing EOF sees GONE
        for fd in (*self._data_fds, *self._ack_fds):
            _close_fd(fd)
        self._release_mapping()


class RingReader(_Endpoint):
    """Reader ``index`` of the ring: sees every message, in order."""

    def __init__(
        self,
        geometry: RingGeometry,
        shm: SharedMemory,
        index: int,
        data_fd: int,
        ack_fd: int,
        *,
        owns_mapping: bool,
    ) -> None:
        super().__init__(geometry, shm, owns_mapping=owns_mapping)
        self.index = index
        offset = geometry.reader_offset(index)
        try:
            self._claim(offset + _R_STATE, offset + _R_PID, f"reader {index}")
        except BaseException:
            self._release_mapping()
            raise
        self._ack_word = (offset + _R_ACK) // 8
        self._wants_word = (offset + _R_WANTS) // 8
        self._state_word = (offset + _R_STATE) // 4
        self._next = self._u64[self._ack_word] + 1
        self._data_fd = data_fd
        self._ack_fd = ack_fd
        self._writer_gone = False  # the data pipe reached EOF
        self._poller = select.poll()
        self._poller.register(data_fd, select.POLLIN)

    @classmethod
    def attach(cls, handle: RingHandle | str) -> RingReader:
        """The reader endpoint in the process the handle was passed to."""
        if isinstance(handle, str):
            handle = RingHandle.from_json(handle)
        if handle.role != "reader":
            raise ValueError(f"a {handle.role} handle cannot attach a reader")
        if len(handle.data_fds) != 1 or len(handle.ack_fds) != 1:
            raise ValueError("a reader handle carries one data fd and one ack fd")
        _adopt_fds(handle.fds)
        try:
            shm = cls._open_segment(handle)
            return cls(
                handle.geometry,
                shm,
                handle.reader_index,
                handle.data_fds[0],
                handle.ack_fds[0],
                owns_mapping=True,
            )
        except BaseException:
            for fd in handle.fds:
                os.close(fd)
            raise

    @property
    def read_count(self) -> int:
        """How many messages this reader has read (and acknowledged)."""
        return self._next - 1

    def try_read(self) -> bytes | None:
        """The next message, or None when none is published yet. Never blocks.

        Raises ``WriterClosed`` once the writer has closed and every message it published was read.
        """
        if self.closed:
            raise RingClosed("ring reader is closed")
        m = self._next
        offset = self._slots_offset + (m - 1) % self._num_slots * self._stride
        u64 = self._u64
        u32 = self._u32
        if u64[offset >> 3] != m and not self._published_late(offset, m):
            return None
        size = u32[(offset + _S_LENGTH) >> 2]
        if size > self._capacity:
            check_length(size, self._capacity)
        start = offset + SLOT_HEADER
        data = self._buf[start : start + size].tobytes()
        u64[self._ack_word] = m  # after the copy: the slot may be reused from here on
        self._next = m + 1
        _fence_acquire()  # a full barrier: the ack store before the writer's wants load (Dekker)
        _fence_release()
        if u64[_H_WRITER_WANTS >> 3] == m:
            # BlockingIOError: rung already; BrokenPipeError: the writer is gone (the data pipe says so).
            with suppress(BlockingIOError, BrokenPipeError):
                os.write(self._ack_fd, b"\x01")
        return data

    def _published_late(self, offset: int, m: int) -> bool:
        """The slot did not show message ``m``: check what it shows (rule 4), and whether the writer has
        closed. True when a second look finds ``m`` after all."""
        if slot_holds(self._u64[offset >> 3], m, self._num_slots):
            return True
        if self._u32[_H_WRITER_STATE >> 2] != GONE:
            return False
        # The writer stored GONE after its last publish, so after seeing GONE one more look is final.
        if slot_holds(self._u64[offset >> 3], m, self._num_slots):
            return True
        raise WriterClosed("the ring's writer closed")

    def _sleep_for(self, seq: int) -> None:
        """Before sleeping: ask the writer to ring when it publishes ``seq`` (0: stop asking)."""
        self._u64[self._wants_word] = seq
        if seq:
            _full_fence()  # the wants store before the seq load (Dekker)

    def _after_wake(self) -> None:
        if _drain(self._data_fd):
            self._writer_gone = True

    def _check_writer(self) -> None:
        """``try_read`` just found nothing: raise if nothing can come any more.

        A writer that closed stores GONE before it closes its pipe ends, so after EOF ``try_read`` has
        already raised ``WriterClosed`` for a clean close; EOF without it is a death.
        """
        if self._writer_gone:
            raise WriterDied("the ring's writer process is gone")

    def read_blocking(self, timeout: float | None = None) -> bytes:
        """The next message, waiting for it; TimeoutError after ``timeout`` s."""
        data = self.try_read()
        if data is not None:
            return data
        deadline = _deadline(timeout)
        self._sleep_for(self._next)
        try:
            while (data := self.try_read()) is None:
                self._check_writer()
                if self._poller.poll(_poll_ms(_slice(deadline))):
                    self._after_wake()
            return data
        finally:
            if not self.closed:
                self._sleep_for(0)

    async def read(self) -> bytes:
        """The next message, waiting for it. A cancellation point always, a schedule point when it waits."""
        await trio.lowlevel.checkpoint_if_cancelled()
        data = self.try_read()
        if data is not None:
            return data
        self._sleep_for(self._next)
        try:
            while (data := self.try_read()) is None:
                self._check_writer()
                with trio.move_on_after(RECHECK_INTERVAL):
                    await trio.lowlevel.wait_readable(self._data_fd)
                self._after_wake()
            return data
        finally:
            if not self.closed:
                self._sleep_for(0)

    def close(self) -> None:
        """Detach: the writer stops waiting for this reader."""
        if self.closed:
            return
        self.closed = True
        self._u64[self._wants_word] = 0
        self._u32[self._state_word] = GONE  # before the fds close: a writer seeing EOF sees GONE
        _close_fd(self._data_fd)
        _close_fd(self._ack_fd)
        self._release_mapping()


# --------------------------------------------------------------------------------------------------
# The creator.
# --------------------------------------------------------------------------------------------------


class ShmRing:
    """Creates (and on ``close()`` unlinks) the segment and the doorbell pipes, and hands out endpoints.

    Each role (the writer, reader ``i``) is handed out once: in this process (``writer()``,
    ``reader(i)``) or to a subprocess (``handoff_writer()``, ``handoff_reader(i)``).
    """

    def __init__(
        self,
        num_slots: int,
        slot_size: int,
        num_readers: int = 1,
        *,
        name: str | None = None,
        unlink_when_attached: bool = False,
    ) -> None:
        """``unlink_when_attached``: rule 5 (the name goes once every endpoint has attached)."""
        _check_platform()
        self.geometry = geometry = RingGeometry(num_slots, slot_size, num_readers)
        self._shm = SharedMemory(
            name=name or f"trioserve_{secrets.token_hex(8)}", create=True, size=geometry.size
        )
        self.name = self._shm.name
        self._local: list[_Endpoint] = []
        self._open_fds: set[int] = set()
        self._tracked = True  # this process's resource tracker lists the segment
        self._data_pipes: list[tuple[int, int]] = []  # (read end, write end) per reader
        self._ack_pipes: list[tuple[int, int]] = []
        self.closed = False
        try:
            for _ in range(num_readers):
                for pipes in (self._data_pipes, self._ack_pipes):
                    r, w = os.pipe()  # not inheritable; Popen(pass_fds=...) passes them on purpose
                    self._open_fds.update((r, w))
                    os.set_blocking(r, False)
                    os.set_blocking(w, False)
                    pipes.append((r, w))
            u32 = _view(self._shm).cast("I")
            u64 = _view(self._shm).cast("Q")
            u32[_H_NUM_SLOTS // 4] = num_slots
            u32[_H_SLOT_SIZE // 4] = slot_size
            u32[_H_NUM_READERS // 4] = num_readers
            u32[_H_FLAGS // 4] = FLAG_UNLINK_WHEN_ATTACHED if unlink_when_attached else 0
            u64[_H_MAGIC // 8] = MAGIC
            u32.release()
            u64.release()
        except BaseException:
            self.close()
            raise

    def _take(self, fds: Sequence[int], what: str) -> None:
        if self.closed:
            raise RingClosed(f"ring {self.name} is closed")
        if not self._open_fds.issuperset(fds):
            raise RingClosed(f"{what} of ring {self.name} was already handed out")
        self._open_fds.difference_update(fds)

    def _writer_fds(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(w for _, w in self._data_pipes), tuple(r for r, _ in self._ack_pipes)

    def _reader_fds(self, index: int) -> tuple[int, int]:
        self.geometry.reader_offset(index)  # range check
        return self._data_pipes[index][0], self._ack_pipes[index][1]

    def writer(self) -> RingWriter:
        """The writer, in this process."""
        data_fds, ack_fds = self._writer_fds()
        self._take((*data_fds, *ack_fds), "the writer")
        writer = RingWriter(self.geometry, self._shm, data_fds, ack_fds, owns_mapping=False)
        self._local.append(writer)
        return writer

    def reader(self, index: int) -> RingReader:
        """Reader ``index``, in this process."""
        data_fd, ack_fd = self._reader_fds(index)
        self._take((data_fd, ack_fd), f"reader {index}")
        reader = RingReader(self.geometry, self._shm, index, data_fd, ack_fd, owns_mapping=False)
        self._local.append(reader)
        return reader

    def _handle(
        self, role: Literal["writer", "reader"], index: int, data: tuple[int, ...], ack: tuple[int, ...]
    ) -> RingHandle:
        g = self.geometry
        return RingHandle(self.name, g.num_slots, g.slot_size, g.num_readers, role, index, data, ack)

    def _handoff(self, handle: RingHandle, what: str) -> Iterator[RingHandle]:
        self._take(handle.fds, what)
        try:
            yield handle
        finally:
            # The child holds them now (or never will): our copies would hide its death from the pipes.
            for fd in handle.fds:
                os.close(fd)

    @contextmanager
    def handoff_writer(self) -> Iterator[RingHandle]:
        """``with ring.handoff_writer() as handle: Popen([..., handle.to_json()], pass_fds=handle.fds)``."""
        data_fds, ack_fds = self._writer_fds()
        yield from self._handoff(self._handle("writer", -1, data_fds, ack_fds), "the writer")

    @contextmanager
    def handoff_reader(self, index: int) -> Iterator[RingHandle]:
        """``with ring.handoff_reader(i) as handle: Popen([..., handle.to_json()], pass_fds=handle.fds)``."""
        data_fd, ack_fd = self._reader_fds(index)
        yield from self._handoff(self._handle("reader", index, (data_fd,), (ack_fd,)), f"reader {index}")

    def release_tracking(self) -> bool:
        """With rule 5: once every endpoint has attached (the name is gone), take the segment off this
        process's resource tracker. True if it is off (now or before)."""
        if self.closed or not self._tracked:
            return not self._tracked
        u32 = _view(self._shm).cast("I")
        try:
            if not u32[_H_FLAGS // 4] & FLAG_UNLINK_WHEN_ATTACHED or not _all_attached(u32, self.geometry):
                return False
        finally:
            u32.release()
        _unlink_untracked(self._shm)  # normally done already by the last endpoint to attach
        resource_tracker.unregister(f"/{self.name}", "shared_memory")
        self._tracked = False
        return True

    def close(self) -> None:
        """Close this process's endpoints and fds, then unmap and unlink the segment."""
        if self.closed:
            return
        self.closed = True
        for endpoint in self._local:
            endpoint.close()
        self._local.clear()
        # Nothing may attach any more; a handed-out endpoint that never attached stops counting.
        u32 = _view(self._shm).cast("I")
        for offset in (
            _H_WRITER_STATE,
            *(self.geometry.reader_offset(i) + _R_STATE for i in range(self.geometry.num_readers)),
        ):
            if u32[offset // 4] == PENDING:
                u32[offset // 4] = GONE
        u32.release()
        for fd in sorted(self._open_fds):
            _close_fd(fd)
        self._open_fds.clear()
        self._shm.close()
        if not self._tracked:
            return
        try:
            self._shm.unlink()
        except FileNotFoundError:
            # Unlinked already (rule 5, or by hand): our tracker still lists it until we say otherwise.
            resource_tracker.unregister(f"/{self.name}", "shared_memory")

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
