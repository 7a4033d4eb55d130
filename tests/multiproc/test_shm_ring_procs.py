"""The shared-memory ring across real processes: readers started with ``subprocess.Popen`` attach from a
JSON handle and inherited pipe fds, as the engine's workers will.

Each child runs ``CHILD`` below with ``python -c``; it prints one JSON line when it is attached and one
with its result.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from trioserve.transport import shm_ring
from trioserve.transport.shm_ring import ReaderDied, RingHandle, ShmRing, WriterDied

pytestmark = pytest.mark.multiproc

CHILD = r"""
import json, os, random, signal, sys, time, zlib
from trioserve.transport.shm_ring import RingReader, RingWriter, WriterClosed

mode, handle, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)


def say(**fields):
    print(json.dumps(fields), flush=True)


def check(data, expected):
    seq = int.from_bytes(data[:8], "little")
    crc = int.from_bytes(data[8:12], "little")
    if seq != expected or crc != zlib.crc32(data[12:]):
        say(error=f"message {expected}: got seq {seq}, crc ok {crc == zlib.crc32(data[12:])}")
        sys.exit(1)


if mode == "read":  # read until the writer closes, checking order and content, lagging at random
    reader = RingReader.attach(handle)
    say(ready=os.getpid())
    count = 0
    try:
        while True:
            data = reader.read_blocking(timeout=20)
            count += 1
            check(data, count)
            if rng.random() < 0.02:
                time.sleep(rng.random() * 0.002)
    except WriterClosed:
        pass
    reader.close()
    say(count=count)
elif mode == "read-and-exit":  # read a few, then exit without close(): not a detach
    reader = RingReader.attach(handle)
    say(ready=os.getpid())
    for _ in range(seed):
        reader.read_blocking(timeout=20)
    sys.exit(0)
elif mode == "stall":  # attach, then never read
    reader = RingReader.attach(handle)
    say(ready=os.getpid())
    time.sleep(60)
elif mode == "write-then-die":  # publish some messages, then get killed without closing
    writer = RingWriter.attach(handle)
    say(ready=os.getpid())
    for n in range(1, seed + 1):
        body = rng.randbytes(rng.randrange(500))
        writer.write_blocking(n.to_bytes(8, "little") + zlib.crc32(body).to_bytes(4, "little") + body, 20)
    os.kill(os.getpid(), signal.SIGKILL)
"""

TIMEOUT = 30


def message(n: int, rng: random.Random, max_size: int) -> bytes:
    body = rng.randbytes(rng.randrange(max_size - 12 + 1))
    return n.to_bytes(8, "little") + zlib.crc32(body).to_bytes(4, "little") + body


def spawn(mode: str, handle: RingHandle, seed: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, handle.to_json(), str(seed)],
        pass_fds=handle.fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child exited early: {proc.wait(TIMEOUT)}\n{proc.stderr.read() if proc.stderr else ''}"
    result: dict[str, Any] = json.loads(line)
    return result


def finish(proc: subprocess.Popen[str]) -> tuple[int, list[dict[str, Any]], str]:
    out, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, [json.loads(line) for line in out.splitlines()], err


def shm_path(name: str) -> Path:
    return Path("/dev/shm") / name


@pytest.fixture(autouse=True)
def doorbells_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No periodic recheck in this process: its waits must end by a doorbell or a pipe's EOF."""
    monkeypatch.setattr(shm_ring, "RECHECK_INTERVAL", 60.0)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=TIMEOUT)


def test_three_reader_processes_get_every_message_in_order(procs: list[subprocess.Popen[str]]) -> None:
    total, slot_size = 3000, 4096
    ring = ShmRing(num_slots=16, slot_size=slot_size, num_readers=3)
    name = ring.name
    try:
        writer = ring.writer()
        for i in range(3):
            with ring.handoff_reader(i) as handle:
                procs.append(spawn("read", handle, seed=i))
        # No need to wait for the children to attach: pending readers hold the writer back too.
        rng = random.Random(42)
        for n in range(1, total + 1):
            writer.write_blocking(message(n, rng, slot_size), timeout=TIMEOUT)
            if rng.random() < 0.01:
                time.sleep(0.002)  # the readers catch up and sleep on their doorbells
        writer.close()
        for proc in procs:
            code, lines, err = finish(proc)
            assert code == 0, err
            assert lines[-1] == {"count": total}, lines
            assert "resource_tracker" not in err and "leaked" not in err, err
    finally:
        ring.close()
    assert not shm_path(name).exists()


def test_killed_reader_is_reported_promptly(procs: list[subprocess.Popen[str]]) -> None:
    ring = ShmRing(num_slots=8, slot_size=256, num_readers=2)
    name = ring.name
    try:
        writer = ring.writer()
        with ring.handoff_reader(0) as handle:
            procs.append(spawn("read", handle))
        with ring.handoff_reader(1) as handle:
            procs.append(spawn("stall", handle))
        stalled = first_line(procs[1])["ready"]
        rng = random.Random(0)
        for n in range(1, 9):
            assert writer.try_write(message(n, rng, 256))
        assert not writer.try_write(message(9, rng, 256))
        threading.Timer(0.2, os.kill, (stalled, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(ReaderDied) as info:
            writer.write_blocking(message(9, rng, 256), timeout=TIMEOUT)
        assert info.value.reader_index == 1
        assert info.value.pid == stalled
        assert time.monotonic() - start < 2
        procs[1].wait(TIMEOUT)
        time.sleep(0.1)
        assert shm_path(name).exists()  # the dead child's exit unlinked nothing
        writer.close()
        code, lines, err = finish(procs[0])
        assert code == 0, err
        assert lines[-1] == {"count": 8}
    finally:
        ring.close()
    assert not shm_path(name).exists()


def test_reader_that_exits_without_closing_counts_as_dead(procs: list[subprocess.Popen[str]]) -> None:
    with ShmRing(num_slots=4, slot_size=64, num_readers=1) as ring:
        writer = ring.writer()
        with ring.handoff_reader(0) as handle:
            procs.append(spawn("read-and-exit", handle, seed=3))
        for n in range(1, 4):
            writer.write_blocking(n.to_bytes(8, "little"), timeout=TIMEOUT)
        with pytest.raises(ReaderDied):
            for n in range(4, 100):
                writer.write_blocking(n.to_bytes(8, "little"), timeout=TIMEOUT)
    code, _, err = finish(procs[0])
    assert code == 0
    assert err == ""  # and unmapping at exit was quiet


async def test_killed_writer_is_reported_after_its_messages(procs: list[subprocess.Popen[str]]) -> None:
    """The reverse direction: a worker writes, the engine's Trio task is the one reader."""
    count = 40
    with ShmRing(num_slots=4, slot_size=512, num_readers=1) as ring:
        name = ring.name
        reader = ring.reader(0)
        with ring.handoff_writer() as handle:
            procs.append(spawn("write-then-die", handle, seed=count))
        rng = random.Random(count)
        with trio.fail_after(TIMEOUT):
            for n in range(1, count + 1):
                body = rng.randbytes(rng.randrange(500))
                data = await reader.read()
                assert data == n.to_bytes(8, "little") + zlib.crc32(body).to_bytes(4, "little") + body
            with pytest.raises(WriterDied):
                await reader.read()
        assert procs[0].wait(TIMEOUT) == -signal.SIGKILL
    assert not shm_path(name).exists()


def test_a_killed_creator_leaves_no_segment() -> None:
    """If the engine itself is killed, its resource tracker (and only its) unlinks the segment."""
    code = (
        "import sys, time\n"
        "from trioserve.transport.shm_ring import ShmRing\n"
        "ring = ShmRing(num_slots=2, slot_size=64)\n"
        "print(ring.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert shm_path(name).exists()
    proc.kill()
    proc.communicate(timeout=TIMEOUT)
    deadline = time.monotonic() + 5
    while shm_path(name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not shm_path(name).exists()
