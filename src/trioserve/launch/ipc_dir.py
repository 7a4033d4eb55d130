"""The API server's IPC folder (its ZMQ ``ipc://`` socket files), and the sweep of folders that API
servers killed with SIGKILL left behind (nothing of theirs ran to remove them).

Each folder is ``$TMPDIR/trioserve-<pid>-<random>`` and holds an ``owner`` file: the API server's pid,
its start time (field 22 of ``/proc/<pid>/stat``, so a reused pid is not mistaken for the owner) and its
pid namespace. At start-up an API server removes every such folder whose owner is dead.

**Rule.** A folder is removed only when all of these hold: its name is ``trioserve-<pid>-...``; it is a
real folder (not a link) owned by our user; its ``owner`` file parses and names the same pid; the
owner's pid namespace is ours (a pid from another namespace sharing this temp folder says nothing
here); and no process with that pid and start time is running. Anything else is left alone: a folder
without an owner file (an older version's, or one being created this very moment), someone else's,
or one whose owner cannot be checked (no ``/proc``).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PREFIX = "trioserve-"
OWNER_FILE = "owner"


@dataclass(frozen=True, slots=True)
class Owner:
    pid: int
    start_time: str  # /proc/<pid>/stat field 22 (clock ticks since boot)
    pid_namespace: str  # readlink /proc/self/ns/pid, e.g. "pid:[4026531836]"

    def encode(self) -> str:
        return f"{self.pid} {self.start_time} {self.pid_namespace}\n"

    @classmethod
    def decode(cls, text: str) -> Owner | None:
        parts = text.split()
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return cls(int(parts[0]), parts[1], parts[2])


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid``; None if it is not running (gone, or a zombie) or unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def current_owner() -> Owner | None:
    """This process as an ``Owner``; None where it cannot be described (no ``/proc``)."""
    start, namespace = process_start_time(os.getpid()), pid_namespace()
    if start is None or namespace is None:
        return None
    return Owner(os.getpid(), start, namespace)


def name_pid(name: str) -> int | None:
    """The pid in a folder name ``trioserve-<pid>-<random>``; None for any other name."""
    if not name.startswith(PREFIX):
        return None
    pid, sep, rest = name[len(PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() and sep and rest else None


def is_stale(
    name: str, owner: Owner | None, our_namespace: str, start_time_of: Callable[[int], str | None]
) -> bool:
    """The rule above, on values already read (``owner``: the parsed owner file, None if missing or
    unreadable; ``start_time_of``: the running process's start time by pid, None if none runs)."""
    pid = name_pid(name)
    if pid is None or owner is None or owner.pid != pid or owner.pid_namespace != our_namespace:
        return False
    return start_time_of(pid) != owner.start_time


def sweep_stale(root: str | None = None) -> list[str]:
    """Remove the stale IPC folders under ``root`` (the temp folder); returns the names removed."""
    root = root or tempfile.gettempdir()
    namespace = pid_namespace()
    if namespace is None:
        return []
    removed = []
    uid = os.getuid()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if name_pid(name) is None:
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            owner = Owner.decode(Path(path, OWNER_FILE).read_text())
        except (OSError, UnicodeDecodeError):
            continue
        if is_stale(name, owner, namespace, process_start_time):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


@contextmanager
def ipc_dir() -> Iterator[str]:
    """A fresh IPC folder with its owner file, removed on exit (a SIGKILL skips that; the next API
    server's sweep does it)."""
    with tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-") as path:
        owner = current_owner()
        if owner is not None:
            staging = os.path.join(path, f".{OWNER_FILE}")
            Path(staging).write_text(owner.encode())
            os.replace(staging, os.path.join(path, OWNER_FILE))  # a reader sees the whole file or none
        yield path
