"""The pure rules behind fault handling: the engine restart backoff, and which IPC folders a starting
API server may sweep."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trioserve.launch import ipc_dir
from trioserve.launch.engine_supervisor import RestartBackoff
from trioserve.launch.ipc_dir import Owner, is_stale, name_pid, sweep_stale

# ------------------------------------------------------------------------------------------ backoff


def test_backoff_doubles_up_to_the_cap_while_engines_never_join() -> None:
    backoff = RestartBackoff()
    delays = [backoff.failed(now=float(t)) for t in range(10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_backoff_keeps_doubling_when_engines_die_soon_after_joining() -> None:
    backoff = RestartBackoff(reset_after=60.0)
    now = 0.0
    delays = []
    for _ in range(4):
        backoff.joined(now)
        now += 59.0  # up, but not for long enough
        delays.append(backoff.failed(now))
    assert delays == [0.5, 1.0, 2.0, 4.0]


def test_backoff_starts_over_after_an_engine_stayed_up() -> None:
    backoff = RestartBackoff(reset_after=60.0)
    assert [backoff.failed(0.0), backoff.failed(1.0), backoff.failed(2.0)] == [0.5, 1.0, 2.0]
    backoff.joined(10.0)
    assert backoff.failed(70.0) == 0.5  # up for exactly reset_after
    assert backoff.failed(71.0) == 1.0  # the next one never joined: the new run continues


def test_backoff_survives_a_very_long_crash_loop() -> None:
    backoff = RestartBackoff(base=0.5, cap=30.0)
    for t in range(5000):
        assert backoff.failed(float(t)) <= 30.0


# ------------------------------------------------------------------------------------------ IPC folders

NS = "pid:[4026531836]"


def test_name_pid() -> None:
    assert name_pid("trioserve-123-abc") == 123
    assert name_pid("trioserve-123-") is None
    assert name_pid("trioserve-x-abc") is None
    assert name_pid("trioserve_123_abc") is None
    assert name_pid("other-123-abc") is None


def test_owner_round_trip() -> None:
    owner = Owner(42, "12345", NS)
    assert Owner.decode(owner.encode()) == owner
    assert Owner.decode("") is None
    assert Owner.decode("42 x pid:[1]") is None


@pytest.mark.parametrize(
    ("name", "owner", "running", "stale"),
    [
        ("trioserve-42-a", Owner(42, "100", NS), None, True),  # the owner is gone
        ("trioserve-42-a", Owner(42, "100", NS), "999", True),  # pid 42 is someone else now
        ("trioserve-42-a", Owner(42, "100", NS), "100", False),  # the owner runs
        ("trioserve-42-a", None, None, False),  # no owner file: never ours to judge
        ("trioserve-42-a", Owner(43, "100", NS), None, False),  # owner file and name disagree
        ("trioserve-42-a", Owner(42, "100", "pid:[7]"), None, False),  # another pid namespace
        ("unrelated-42-a", Owner(42, "100", NS), None, False),
    ],
)
def test_is_stale(name: str, owner: Owner | None, running: str | None, stale: bool) -> None:
    assert is_stale(name, owner, NS, lambda pid: running) is stale


def test_sweep_removes_only_dead_owners_folders(tmp_path: Path) -> None:
    me = ipc_dir.current_owner()
    if me is None:
        pytest.skip("no /proc here: nothing can be checked, nothing is swept")
    dead = Owner(me.pid, "1", me.pid_namespace)  # our pid with a start time that is not ours
    folders = {
        f"trioserve-{me.pid}-live": me,
        f"trioserve-{me.pid}-dead": dead,
        f"trioserve-{me.pid}-nofile": None,
    }
    for name, owner in folders.items():
        (tmp_path / name).mkdir()
        if owner is not None:
            (tmp_path / name / "owner").write_text(owner.encode())
        (tmp_path / name / "input").write_text("")  # a socket file stands in
    (tmp_path / "trioserve-1-file").write_text(dead.encode())  # not a folder
    assert sweep_stale(str(tmp_path)) == [f"trioserve-{me.pid}-dead"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["trioserve-1-file", f"trioserve-{me.pid}-live", f"trioserve-{me.pid}-nofile"]
    )


def test_ipc_dir_writes_its_owner_and_removes_itself() -> None:
    if ipc_dir.current_owner() is None:
        pytest.skip("no /proc here: the folder gets no owner file")
    with ipc_dir.ipc_dir() as path:
        owner = Owner.decode(Path(path, "owner").read_text())
        assert owner == ipc_dir.current_owner()
        assert name_pid(os.path.basename(path)) == os.getpid()
        assert owner is not None
        name = os.path.basename(path)
        assert not is_stale(name, owner, owner.pid_namespace, ipc_dir.process_start_time)
    assert not os.path.exists(path)
