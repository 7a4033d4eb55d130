"""The shared-memory ring's layout and rules: a single-writer, many-reader ring of fixed-size slots in
shared memory (design §8).

The engine core puts each step's ``SchedulerOutput`` on one of these for its workers; the same class with
one reader carries results back from the output rank. Payloads are opaque bytes (the caller encodes
msgspec frames); the ring adds a sequence number and a length, nothing else.

This module is the ring's specification and its pure core, with no I/O: the offsets, the geometry, the
checks on values read from the segment, and the ``RingHandle`` a subprocess attaches with. The mapping,
the endpoints, the doorbells and the waits live in ``trioserve.transport.shm_ring`` and follow these
rules.

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

MAGIC = int.from_bytes(b"tsring01", "little")
LINE = 64
HEADER_SIZE = LINE
READER_AREA = LINE
SLOT_HEADER = 16
MAX_SLOT_SIZE = 2**32 - 1 - LINE  # the length is a u32
MAX_READERS = 256

# Byte offsets of the fields. Header:
H_MAGIC = 0  # u64
H_NUM_SLOTS = 8  # u32
H_SLOT_SIZE = 12  # u32
H_NUM_READERS = 16  # u32
H_WRITER_PID = 20  # u32
H_WRITER_STATE = 24  # u32
H_FLAGS = 28  # u32: the creator's options, written before anyone attaches
H_WRITER_WANTS = 32  # u64: the ack the writer sleeps for, 0 when it is not sleeping
# Within reader i's line:
R_ACK = 0  # u64
R_WANTS = 8  # u64: the message the reader sleeps for, 0 when it is not sleeping
R_PID = 16  # u32
R_STATE = 20  # u32
# Within a slot:
S_SEQ = 0  # u64
S_LENGTH = 8  # u32

FLAG_UNLINK_WHEN_ATTACHED = 1  # rule 5

# Endpoint states (writer state and reader state).
PENDING, ATTACHED, GONE = 0, 1, 2
STATES = (PENDING, ATTACHED, GONE)


# --------------------------------------------------------------------------------------------------
# Errors of the layout's checks (the endpoints' own errors are in transport/shm_ring.py).
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
