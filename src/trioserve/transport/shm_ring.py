"""The shared-memory ring's I/O (design §8): the mapping, the endpoints (``RingWriter``, ``RingReader``),
the doorbell pipes and the waits (blocking, and awaitable in Trio), attaching and unlinking (``ShmRing``).

The segment layout and the rules every line here follows (rules 1-5, memory ordering, doorbells, liveness,
processes) are stated in ``trioserve.protocol.ring_layout``; read them there first. The pure checks come
from there too, and so do the layout's errors and ``RingHandle``, which this module re-exports.

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
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import Literal, Self

import trio

from trioserve.protocol.ring_layout import (
    ATTACHED,
    FLAG_UNLINK_WHEN_ATTACHED,
    GONE,
    H_FLAGS,
    H_MAGIC,
    H_NUM_READERS,
    H_NUM_SLOTS,
    H_SLOT_SIZE,
    H_WRITER_PID,
    H_WRITER_STATE,
    H_WRITER_WANTS,
    MAGIC,
    PENDING,
    R_ACK,
    R_PID,
    R_STATE,
    R_WANTS,
    S_LENGTH,
    SLOT_HEADER,
    STATES,
    CorruptRing,
    MessageTooLarge,
    RingGeometry,
    RingHandle,
    ShmRingError,
    check_length,
    slot_holds,
    writable_until,
)

# Callers import the ring from here alone: the endpoints, the creator, every error, and the handle.
__all__ = [
    "RECHECK_INTERVAL",
    "CorruptRing",
    "MessageTooLarge",
    "ReaderDied",
    "RingClosed",
    "RingGeometry",
    "RingHandle",
    "RingReader",
    "RingWriter",
    "ShmRing",
    "ShmRingError",
    "WriterClosed",
    "WriterDied",
]

RECHECK_INTERVAL = 0.25  # seconds a sleeper waits on its doorbell before looking at the memory anyway

_TSO_MACHINES = frozenset({"x86_64", "amd64"})


# --------------------------------------------------------------------------------------------------
# The endpoints' errors (the base class and the layout's errors are in protocol/ring_layout.py).
# --------------------------------------------------------------------------------------------------


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
# Small I/O helpers.
# --------------------------------------------------------------------------------------------------

_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release


def _full_fence() -> None:
    """A full memory barrier on x86 (ring_layout, "Memory ordering"): a locked instruction inside glibc."""
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
    offsets = (H_WRITER_STATE, *(geometry.reader_offset(i) + R_STATE for i in range(geometry.num_readers)))
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
        self._u64 = buf.cast("Q")  # aligned 8-byte loads and stores (ring_layout, "Memory ordering")
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
                    u64[H_MAGIC // 8],
                    u32[H_NUM_SLOTS // 4],
                    u32[H_SLOT_SIZE // 4],
                    u32[H_NUM_READERS // 4],
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
        if state not in STATES:
            raise CorruptRing(f"unknown endpoint state {state} at offset {offset}")
        return state

    def _claim(self, state_offset: int, pid_offset: int, what: str) -> None:
        if self._state(state_offset) != PENDING:
            raise RingClosed(f"{what} of ring {self._shm.name} is already attached or closed")
        self._u32[pid_offset // 4] = os.getpid()
        self._u32[state_offset // 4] = ATTACHED
        if self._u32[H_FLAGS // 4] & FLAG_UNLINK_WHEN_ATTACHED:
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
            self._claim(H_WRITER_STATE, H_WRITER_PID, "the writer")
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
            ((self.geometry.reader_offset(i) + R_WANTS) // 8, self._data_fds[i], i) for i in self._live
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
        if self._state(offset + R_STATE) != GONE:
            raise ReaderDied(index, self._u32[(offset + R_PID) // 4])
        self._drop(index)

    def _refresh_limit(self) -> None:
        acks = []
        for i in list(self._live):
            offset = self.geometry.reader_offset(i)
            if self._state(offset + R_STATE) == GONE:
                self._drop(i)
                continue
            ack = self._u64[(offset + R_ACK) // 8]
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
        self._u32[(offset + S_LENGTH) >> 2] = size
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
        self._u64[H_WRITER_WANTS // 8] = ack
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
        self._u64[H_WRITER_WANTS // 8] = 0
        self._u32[H_WRITER_STATE // 4] = GONE  # before the fds close: a reader seeing EOF sees GONE
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
            self._claim(offset + R_STATE, offset + R_PID, f"reader {index}")
        except BaseException:
            self._release_mapping()
            raise
        self._ack_word = (offset + R_ACK) // 8
        self._wants_word = (offset + R_WANTS) // 8
        self._state_word = (offset + R_STATE) // 4
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
        size = u32[(offset + S_LENGTH) >> 2]
        if size > self._capacity:
            check_length(size, self._capacity)
        start = offset + SLOT_HEADER
        data = self._buf[start : start + size].tobytes()
        u64[self._ack_word] = m  # after the copy: the slot may be reused from here on
        self._next = m + 1
        _fence_acquire()  # a full barrier: the ack store before the writer's wants load (Dekker)
        _fence_release()
        if u64[H_WRITER_WANTS >> 3] == m:
            # BlockingIOError: rung already; BrokenPipeError: the writer is gone (the data pipe says so).
            with suppress(BlockingIOError, BrokenPipeError):
                os.write(self._ack_fd, b"\x01")
        return data

    def _published_late(self, offset: int, m: int) -> bool:
        """The slot did not show message ``m``: check what it shows (rule 4), and whether the writer has
        closed. True when a second look finds ``m`` after all."""
        if slot_holds(self._u64[offset >> 3], m, self._num_slots):
            return True
        if self._u32[H_WRITER_STATE >> 2] != GONE:
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
            u32[H_NUM_SLOTS // 4] = num_slots
            u32[H_SLOT_SIZE // 4] = slot_size
            u32[H_NUM_READERS // 4] = num_readers
            u32[H_FLAGS // 4] = FLAG_UNLINK_WHEN_ATTACHED if unlink_when_attached else 0
            u64[H_MAGIC // 8] = MAGIC
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
            if not u32[H_FLAGS // 4] & FLAG_UNLINK_WHEN_ATTACHED or not _all_attached(u32, self.geometry):
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
            H_WRITER_STATE,
            *(self.geometry.reader_offset(i) + R_STATE for i in range(self.geometry.num_readers)),
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
