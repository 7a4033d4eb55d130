"""The shared-memory ring in one process: endpoints sharing the creator's mapping (exact order over many
laps, a full ring, corruption, closing), then the Trio API. The pure layout is in test_ring_layout.py."""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import msgspec
import pytest
import trio

from trioserve.transport import shm_ring
from trioserve.transport.shm_ring import (
    CorruptRing,
    MessageTooLarge,
    ReaderDied,
    RingClosed,
    RingHandle,
    RingReader,
    RingWriter,
    ShmRing,
    WriterClosed,
    WriterDied,
)

# The documented layout (protocol/ring_layout.py's docstring): where tests poke corruption in.
SLOT_LENGTH = 8  # u32 after the slot's u64 sequence number
READER_ACK = 0  # u64 at the start of a reader's line
READER_STATE = 20  # u32


@pytest.fixture(autouse=True)
def doorbells_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No periodic recheck: every wait in these tests must end by a doorbell (or fail by timing out)."""
    monkeypatch.setattr(shm_ring, "RECHECK_INTERVAL", 60.0)


@pytest.fixture
def ring() -> Iterator[ShmRing]:
    ring = ShmRing(num_slots=4, slot_size=256, num_readers=2)
    try:
        yield ring
    finally:
        ring.close()


def message(n: int, size: int | None = None) -> bytes:
    """Message ``n``: its number, a checksum, then bytes that depend on ``n``."""
    body = random.Random(n).randbytes(n % 200 if size is None else size)
    return n.to_bytes(8, "little") + zlib.crc32(body).to_bytes(4, "little") + body


def poke(ring: ShmRing, offset: int, value: int, width: int) -> None:
    shm = SharedMemory(ring.name)  # the creator's tracker registered the name already
    try:
        assert shm.buf is not None
        shm.buf[offset : offset + width] = value.to_bytes(width, "little")
    finally:
        shm.close()


# ------------------------------------------------------------------------------------------ in one process


def test_every_reader_sees_every_message_in_order_over_many_laps(ring: ShmRing) -> None:
    writer = ring.writer()
    readers = [ring.reader(0), ring.reader(1)]
    rng = random.Random(1)
    got: list[list[bytes]] = [[], []]
    n = 0
    while n < 2000:  # 500 laps of 4 slots, readers draining at random moments
        while writer.try_write(message(n + 1)):
            n += 1
        for reader, out in zip(readers, got, strict=True):
            for _ in range(rng.randint(0, 4)):
                data = reader.try_read()
                if data is None:
                    break
                out.append(data)
    for reader, out in zip(readers, got, strict=True):
        while (data := reader.try_read()) is not None:
            out.append(data)
        assert out == [message(k) for k in range(1, n + 1)]
        assert reader.read_count == n
    assert writer.written == n


def test_payload_sizes_up_to_exactly_the_slot(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    ring.reader(1).close()
    for payload in (b"", b"x", bytes(range(256)), bytearray(b"y" * 255), memoryview(b"z" * 256)):
        assert writer.try_write(payload)
        assert reader.try_read() == bytes(payload)


def test_too_large_message_is_refused_and_nothing_is_published(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    with pytest.raises(MessageTooLarge, match="257 bytes does not fit a ring slot of 256") as info:
        writer.try_write(bytes(257))
    assert (info.value.size, info.value.capacity) == (257, 256)
    with pytest.raises(MessageTooLarge):
        writer.write_blocking(bytes(10_000), timeout=0)
    assert writer.written == 0
    assert reader.try_read() is None


def test_writer_waits_for_the_slowest_reader(ring: ShmRing) -> None:
    writer = ring.writer()
    fast, slow = ring.reader(0), ring.reader(1)
    for n in range(1, 5):
        assert writer.try_write(message(n))
    assert not writer.try_write(message(5))  # four slots, nobody has read
    for n in range(1, 5):
        assert fast.try_read() == message(n)
    assert not writer.try_write(message(5))  # the slow reader still holds all four
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        writer.write_blocking(message(5), timeout=0.05)
    assert 0.04 < time.monotonic() - start < 1
    assert slow.try_read() == message(1)
    assert writer.try_write(message(5))  # exactly one slot came free
    assert not writer.try_write(message(6))


def test_blocked_writer_wakes_when_lagging_readers_ack(ring: ShmRing) -> None:
    writer = ring.writer()
    readers = [ring.reader(0), ring.reader(1)]
    total = 300
    errors: list[BaseException] = []

    def write_all() -> None:
        try:
            for n in range(1, total + 1):
                writer.write_blocking(message(n), timeout=10)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=write_all)
    thread.start()
    rng = random.Random(2)
    got: list[list[bytes]] = [[], []]
    deadline = time.monotonic() + 5  # a writer woken only by its own timeouts would take minutes
    while any(len(out) < total for out in got) and not errors and time.monotonic() < deadline:
        for reader, out in zip(readers, got, strict=True):
            if len(out) < total and (data := reader.try_read()) is not None:
                out.append(data)
        if rng.random() < 0.05:
            time.sleep(0.001)  # the readers lag: the writer sleeps on its ack doorbells
    thread.join(10)
    assert not errors
    assert got == [[message(n) for n in range(1, total + 1)]] * 2


def test_blocking_reader_times_out_then_gets_the_message(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    ring.reader(1).close()
    with pytest.raises(TimeoutError):
        reader.read_blocking(timeout=0.02)
    threading.Timer(0.05, writer.write_blocking, (b"late",)).start()
    assert reader.read_blocking(timeout=5) == b"late"


def test_a_closed_reader_no_longer_holds_the_writer_back(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    lagging = ring.reader(1)
    for n in range(1, 5):
        assert writer.try_write(message(n))
        assert reader.try_read() == message(n)
    assert not writer.try_write(message(5))
    lagging.close()
    for n in range(5, 50):
        writer.write_blocking(message(n), timeout=1)
        assert reader.try_read() == message(n)
    with pytest.raises(RingClosed):
        lagging.try_read()


def test_readers_finish_the_messages_then_see_the_writer_closed(ring: ShmRing) -> None:
    writer = ring.writer()
    readers = [ring.reader(0), ring.reader(1)]
    for n in (1, 2, 3):
        writer.write_blocking(message(n))
    writer.close()
    with pytest.raises(RingClosed):
        writer.try_write(b"x")
    assert [readers[0].try_read() for _ in range(3)] == [message(1), message(2), message(3)]
    with pytest.raises(WriterClosed):
        readers[0].try_read()
    assert readers[1].read_blocking(timeout=1) == message(1)
    assert readers[1].read_blocking(timeout=1) == message(2)
    assert readers[1].read_blocking(timeout=1) == message(3)
    with pytest.raises(WriterClosed):
        readers[1].read_blocking(timeout=1)


def test_reader_that_never_attaches_is_reported_dead(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    with ring.handoff_reader(1):
        pass  # the spawn "failed": the child never got its pipe ends
    for n in range(1, 5):
        assert writer.try_write(message(n))
        assert reader.try_read() == message(n)
    with pytest.raises(ReaderDied, match="ring reader 1 died \\(before it attached\\)") as info:
        writer.write_blocking(message(5), timeout=5)
    assert info.value.reader_index == 1
    with pytest.raises(ReaderDied):
        writer.check_readers()


def test_writer_that_never_attaches_is_reported_dead(ring: ShmRing) -> None:
    reader = ring.reader(0)
    with ring.handoff_writer():
        pass
    with pytest.raises(WriterDied):
        reader.read_blocking(timeout=5)


def test_each_role_is_handed_out_once(ring: ShmRing) -> None:
    ring.reader(0)
    with pytest.raises(RingClosed, match="already handed out"):
        ring.reader(0)
    with ring.handoff_writer() as handle:
        assert handle.role == "writer"
        assert len(handle.data_fds) == len(handle.ack_fds) == 2
        with pytest.raises(RingClosed, match="already handed out"):
            ring.writer()
    with pytest.raises(IndexError):
        ring.reader(2)


def test_handoff_closes_the_creators_copies(ring: ShmRing) -> None:
    with ring.handoff_reader(1) as handle:
        for fd in handle.fds:
            os.fstat(fd)
        assert RingHandle.from_json(handle.to_json()) == handle
    for fd in handle.fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(RingClosed, match="not open in this process"):
        RingReader.attach(handle)


# ------------------------------------------------------------------------------------------ corruption


def test_corrupt_length_is_detected_before_any_copy(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    writer.try_write(b"hello")
    poke(ring, ring.geometry.slot_offset(1) + SLOT_LENGTH, 2**32 - 1, 4)
    with pytest.raises(CorruptRing, match="slot length 4294967295 exceeds the slot size 256"):
        reader.try_read()


def test_corrupt_sequence_number_is_detected(ring: ShmRing) -> None:
    writer = ring.writer()
    reader = ring.reader(0)
    writer.try_write(b"hello")
    poke(ring, ring.geometry.slot_offset(1), 12345, 8)
    with pytest.raises(CorruptRing, match="holds sequence number 12345"):
        reader.try_read()


def test_corrupt_ack_and_state_are_detected_by_the_writer(ring: ShmRing) -> None:
    writer = ring.writer()
    ring.reader(0)
    ring.reader(1)
    for n in range(1, 5):
        writer.try_write(message(n))
    poke(ring, ring.geometry.reader_offset(1) + READER_ACK, 99, 8)
    with pytest.raises(CorruptRing, match="acknowledged message 99 but 4 were written"):
        writer.try_write(message(5))
    poke(ring, ring.geometry.reader_offset(1) + READER_ACK, 0, 8)
    poke(ring, ring.geometry.reader_offset(1) + READER_STATE, 77, 4)
    with pytest.raises(CorruptRing, match="unknown endpoint state 77"):
        writer.try_write(message(5))


def test_attaching_checks_the_header_against_the_handle(ring: ShmRing) -> None:
    with ring.handoff_reader(1) as handle:

        def wrong(**changes: int) -> RingHandle:
            # Attaching closes the handle's fds when it fails: give each attempt copies.
            fds = {"data_fds": (os.dup(handle.data_fds[0]),), "ack_fds": (os.dup(handle.ack_fds[0]),)}
            return msgspec.structs.replace(handle, **changes, **fds)

        with pytest.raises(CorruptRing, match="the handle needs"):
            RingReader.attach(wrong(slot_size=handle.slot_size * 2))
        with pytest.raises(CorruptRing, match="header"):
            RingReader.attach(wrong(num_slots=2))
        with pytest.raises(ValueError, match="cannot attach a writer"):
            RingWriter.attach(handle)
        poke(ring, 0, 0, 8)  # the magic
        with pytest.raises(CorruptRing, match="header"):
            RingReader.attach(wrong())


# ------------------------------------------------------------------------------------------ lifetime


def test_close_unlinks_the_segment_and_closes_every_endpoint() -> None:
    ring = ShmRing(num_slots=2, slot_size=64, num_readers=1)
    path = Path("/dev/shm") / ring.name
    writer = ring.writer()
    reader = ring.reader(0)
    writer.try_write(b"x")
    if Path("/dev/shm").is_dir():
        assert path.exists()
    ring.close()
    ring.close()  # idempotent
    assert not path.exists()
    with pytest.raises(RingClosed):
        writer.try_write(b"y")
    with pytest.raises(RingClosed):
        reader.try_read()
    with pytest.raises(FileNotFoundError):
        SharedMemory(ring.name)


def test_context_managers_close(ring: ShmRing) -> None:
    writer = ring.writer()
    with writer as entered:
        assert entered is writer
    assert writer.closed
    with ShmRing(num_slots=1, slot_size=8) as other:
        name = other.name
    with pytest.raises(FileNotFoundError):
        SharedMemory(name)


# ------------------------------------------------------------------------------------------ Trio


async def test_async_readers_and_writer_in_order_with_lag() -> None:
    total = 400
    got: list[list[bytes]] = [[], [], []]
    with ShmRing(num_slots=4, slot_size=256, num_readers=3) as ring:
        writer = ring.writer()
        readers = [ring.reader(i) for i in range(3)]

        async def read_all(index: int) -> None:
            rng = random.Random(index)
            for _ in range(total):
                got[index].append(await readers[index].read())
                if rng.random() < 0.05:
                    await trio.sleep(0.001)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(read_all, i)
                rng = random.Random(9)
                for n in range(1, total + 1):
                    await writer.write(message(n))
                    if rng.random() < 0.05:
                        await trio.sleep(0.001)  # now the readers wait on their doorbells
        writer.close()
        with pytest.raises(WriterClosed):
            await readers[0].read()
    assert got == [[message(n) for n in range(1, total + 1)]] * 3


async def test_async_wakeups_come_from_the_doorbells() -> None:
    with ShmRing(num_slots=1, slot_size=64, num_readers=1) as ring:
        writer = ring.writer()
        reader = ring.reader(0)
        with trio.fail_after(5):  # the recheck is off: only the doorbells can wake either side
            async with trio.open_nursery() as nursery:

                async def write_late() -> None:
                    await trio.sleep(0.02)
                    await writer.write(b"1")
                    await writer.write(b"2")  # the one slot is taken: waits for the ack doorbell

                nursery.start_soon(write_late)
                assert await reader.read() == b"1"
                await trio.sleep(0.02)
                assert await reader.read() == b"2"


async def test_cancelled_read_loses_nothing() -> None:
    with ShmRing(num_slots=2, slot_size=64, num_readers=1) as ring:
        writer = ring.writer()
        reader = ring.reader(0)
        with trio.move_on_after(0.01) as scope:
            await reader.read()
        assert scope.cancelled_caught
        writer.try_write(b"after")
        assert await reader.read() == b"after"
        with trio.CancelScope() as scope:
            scope.cancel()
            await reader.read()  # cancelled before it looks
        writer.try_write(b"kept")
        assert reader.try_read() == b"kept"


async def test_async_writer_reports_a_dead_reader() -> None:
    with ShmRing(num_slots=2, slot_size=64, num_readers=2) as ring:
        writer = ring.writer()
        with ring.handoff_reader(1):
            pass
        ring.reader(0)
        assert writer.try_write(b"a")
        assert writer.try_write(b"b")
        with trio.fail_after(5), pytest.raises(ReaderDied) as info:
            await writer.write(b"c")
        assert info.value.reader_index == 1
