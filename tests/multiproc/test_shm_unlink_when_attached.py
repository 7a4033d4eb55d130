"""The ring's rule 5 (``unlink_when_attached``): the segment's name leaves ``/dev/shm`` once every
endpoint has attached, so no kill afterwards (of the creator, of an attached process, of both) can
leave it behind, and the creator's resource tracker stays quiet about it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trioserve.transport.shm_ring import ShmRing

pytestmark = pytest.mark.multiproc

TIMEOUT = 30


def shm_path(name: str) -> Path:
    return Path("/dev/shm") / name


def wait_gone(path: Path, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_last_local_attach_unlinks_and_the_ring_still_works() -> None:
    with ShmRing(num_slots=2, slot_size=64, num_readers=2, unlink_when_attached=True) as ring:
        path = shm_path(ring.name)
        writer = ring.writer()
        first = ring.reader(0)
        assert path.exists()  # reader 1 is still pending
        second = ring.reader(1)
        assert not path.exists()
        for n in range(5):
            assert writer.try_write(bytes([n]))
            assert first.try_read() == bytes([n])
            assert second.try_read() == bytes([n])
    assert not path.exists()


def test_without_the_flag_the_name_stays_until_close() -> None:
    with ShmRing(num_slots=2, slot_size=64, num_readers=1) as ring:
        path = shm_path(ring.name)
        ring.writer()
        ring.reader(0)
        assert path.exists()
    assert not path.exists()


CREATOR = r"""
import sys
from trioserve.transport.shm_ring import ShmRing
ring = ShmRing(num_slots=2, slot_size=64, unlink_when_attached=True)
writer, reader = ring.writer(), ring.reader(0)
print(ring.name, flush=True)
writer.try_write(b"x")
assert reader.try_read() == b"x"
ring.close()
"""


def test_close_after_an_early_unlink_is_quiet() -> None:
    """``close`` finds the name gone and unregisters it: the tracker reports no leak at exit."""
    done = subprocess.run(
        [sys.executable, "-c", CREATOR], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert not shm_path(done.stdout.strip()).exists()


ATTACHER = r"""
import os, sys, time
from trioserve.transport.shm_ring import RingReader
reader = RingReader.attach(sys.argv[1])
print(os.getpid(), flush=True)
time.sleep(60)
"""

KILLED_CREATOR = r"""
import subprocess, sys, time
from trioserve.transport.shm_ring import ShmRing
ring = ShmRing(num_slots=2, slot_size=64, unlink_when_attached=True)
writer = ring.writer()
with ring.handoff_reader(0) as handle:
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], handle.to_json()], pass_fds=handle.fds, stdout=subprocess.PIPE
    )
print(ring.name, child.pid, child.stdout.readline().decode().strip(), flush=True)
time.sleep(60)
"""


def test_a_creator_and_its_attached_child_both_killed_leave_no_segment() -> None:
    """SIGKILL of both processes (and so no ``close``, no tracker run that could matter): the name went
    when the child attached."""
    creator = subprocess.Popen(
        [sys.executable, "-c", KILLED_CREATOR, ATTACHER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert creator.stdout is not None
        name, pid, attached = creator.stdout.readline().split()
        child = int(pid)
        try:
            assert attached == pid  # the child has attached
            assert not shm_path(name).exists()
            assert name in Path(f"/proc/{child}/maps").read_text()  # still mapped, by a deleted name
        finally:
            # The child first, while its parent (the creator) is alive: its pid cannot be reused yet.
            os.kill(child, signal.SIGKILL)
        creator.kill()
        creator.communicate(timeout=TIMEOUT)
        assert not shm_path(name).exists()
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.communicate(timeout=TIMEOUT)


RELEASED_THEN_KILLED = r"""
import os, signal
from trioserve.transport.shm_ring import ShmRing
ring = ShmRing(num_slots=2, slot_size=64, unlink_when_attached=True)
assert not ring.release_tracking()  # nothing attached yet: the tracker must keep it
writer, reader = ring.writer(), ring.reader(0)
assert ring.release_tracking()
print(ring.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_creator_killed_after_release_tracking_leaves_its_tracker_quiet() -> None:
    """Without ``release_tracking`` the killed creator's tracker would warn about two "leaked"
    segments and fail to unlink names that are gone already."""
    done = subprocess.run(
        [sys.executable, "-c", RELEASED_THEN_KILLED],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL
    name = done.stdout.strip()
    assert name.startswith("trioserve_")
    assert not shm_path(name).exists()
    # The orphaned tracker shares the child's stderr: ``run`` returned after it, too, had exited.
    assert "resource_tracker" not in done.stderr, done.stderr
