"""Faults through the real process tree (docs/faults.md): SIGKILL of the worker, of the engine core
and of the API server, with a tiny random Llama behind ``--engine model`` so that every process of the
tree is there.

What each test checks: what clients see (an error event and a proper end for a stream in flight, 503
with ``Retry-After`` for new requests, ``/health``), that the engine comes back (restarts, the restart
counter) or the API server exits (``--engine-restart never``), and that nothing is left behind: no
process (found by parent pid and checked by pid *and* start time, never by name) and no shared-memory
segment (the names the worker's own mappings show, not every ``trioserve_*`` in ``/dev/shm``, which
other tests create too).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from trioserve.launch.ipc_dir import Owner, current_owner

from ._support import (
    RawHttp,
    chat_body,
    ipc_dirs,
    post,
    proc_alive,
    proc_children,
    proc_start_time,
    proc_title,
    request_json,
)
from .conftest import ServerProcess
from .test_model_engine import segments_of, start_model_server, tiny_model

__all__ = ["tiny_model"]  # the module fixture, shared with test_model_engine.py

TIMEOUT = 60


@dataclass(frozen=True)
class Proc:
    pid: int
    start_time: str

    @classmethod
    def of(cls, pid: int) -> Proc:
        start = proc_start_time(pid)
        assert start is not None, f"process {pid} is already gone"
        return cls(pid, start)

    def alive(self) -> bool:
        return proc_alive(self.pid, self.start_time)

    def kill_if_alive(self) -> bool:
        """SIGKILL it if it is still the same process; True if it had to be killed."""
        if not self.alive():
            return False
        os.kill(self.pid, signal.SIGKILL)
        return True


@dataclass(frozen=True)
class Tree:
    """An API server's engine core, its worker, and the segments the worker has mapped."""

    engine: Proc
    worker: Proc | None
    segments: frozenset[str]

    @property
    def procs(self) -> list[Proc]:
        return [self.engine, *([self.worker] if self.worker else [])]


def in_dev_shm(names: frozenset[str]) -> set[str]:
    return {name for name in names if (Path("/dev/shm") / name).exists()}


def tree_of(server: ServerProcess) -> Tree:
    engines = [pid for pid in proc_children(server.pid) if proc_title(pid) == "trioserve::EngineCore"]
    assert len(engines) == 1, engines
    workers = [pid for pid in proc_children(engines[0]) if proc_title(pid) == "trioserve::Worker"]
    assert len(workers) <= 1, workers
    worker = Proc.of(workers[0]) if workers else None
    return Tree(Proc.of(engines[0]), worker, frozenset(segments_of(workers[0])) if workers else frozenset())


async def eventually(check: Callable[[], bool], timeout: float = TIMEOUT) -> bool:
    with trio.move_on_after(timeout):
        while not check():  # noqa: ASYNC110  (another process's state: nothing to wait on)
            await trio.sleep(0.05)
        return True
    return False


async def until(check: Callable[[], Awaitable[bool]], timeout: float = TIMEOUT) -> bool:
    with trio.move_on_after(timeout):
        while not await check():  # noqa: ASYNC110  (another process's state: nothing to wait on)
            await trio.sleep(0.1)
        return True
    return False


async def health(server: ServerProcess) -> int:
    status, _ = await request_json(server.host, server.port, "GET", "/health")
    return status


async def restarts(server: ServerProcess) -> int:
    async with await RawHttp.connect(server.host, server.port) as conn:
        await conn.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response = await conn.read_response()
    (line,) = [
        ln for ln in response.body.decode().splitlines() if ln.startswith("trioserve:engine_restarts_total")
    ]
    return int(float(line.rsplit(" ", 1)[1]))


async def stream_through(server: ServerProcess, fault: Callable[[], None]) -> str:
    """A long stream; ``fault`` once it runs; the rest of the stream, as text."""
    async with await RawHttp.connect(server.host, server.port) as conn:
        await conn.send(post("/v1/chat/completions", chat_body(400, stream=True)))
        head = await conn.read_head()
        assert head.status == 200
        first = await conn.read_chunk()
        fault()
        rest = await conn.read_body(head)
    return (first + rest.body).decode()


async def refused_while_down(server: ServerProcess) -> None:
    async with await RawHttp.connect(server.host, server.port) as conn:
        await conn.send(post("/v1/chat/completions", chat_body(4)))
        response = await conn.read_response()
    assert response.status == 503, response.body
    assert "the engine is unavailable" in response.json()["error"]["message"]
    assert int(response.header("retry-after") or "0") >= 1


async def completes(server: ServerProcess) -> None:
    status, body = await request_json(server.host, server.port, "POST", "/v1/chat/completions", chat_body(4))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4


def stop_and_check(server: ServerProcess, trees: list[Tree]) -> None:
    """Stop ``server``; every process of every tree it had must be gone, and every segment."""
    server.stop()
    leftovers = []
    deadline = time.monotonic() + 15
    for proc in (p for tree in trees for p in tree.procs):
        while proc.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.kill_if_alive():
            leftovers.append(proc.pid)
    segments = {name for tree in trees for name in in_dev_shm(tree.segments)}
    assert not leftovers, f"{server.name}: processes outlived their API server: {leftovers}"
    assert not segments, f"{server.name}: segments left in /dev/shm: {segments}"
    assert not server.problems, server.problems


@dataclass
class Restarting:
    server: ServerProcess
    trees: list[Tree]  # every tree it has had, the current one last


@pytest.fixture(scope="module")
def restarting(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restarting]:
    """A model server whose engine the tests below kill; teardown: nothing of any of its trees left."""
    server = start_model_server(tiny_model, tmp_path_factory.mktemp("logs"), "restarting")
    trees: list[Tree] = []
    try:
        server.wait_ready(TIMEOUT)
        trees.append(tree_of(server))
        yield Restarting(server, trees)
    finally:
        stop_and_check(server, trees)
    assert server.proc is not None
    assert server.proc.returncode == 0


async def kill_and_recover(restarting: Restarting, victim: str) -> str:
    server, trees = restarting.server, restarting.trees
    before = trees[-1]
    assert before.worker is not None
    assert len(before.segments) == 2, before.segments  # the step ring and the result ring
    # Rule 5 of the ring: their names are gone already; the worker maps them by deleted names.
    assert in_dev_shm(before.segments) == set()
    count = await restarts(server)
    target = before.worker if victim == "worker" else before.engine
    with trio.fail_after(TIMEOUT):
        text = await stream_through(server, lambda: os.kill(target.pid, signal.SIGKILL))
    assert '"error"' in text, text[-500:]
    assert text.rstrip().endswith("data: [DONE]")
    assert await health(server) == 503
    await refused_while_down(server)
    assert await until(lambda: _is_up(server)), f"not healthy again:\n{server.log_tail()}"
    after = tree_of(server)
    trees.append(after)
    assert after.engine != before.engine
    assert after.worker is not None
    assert after.worker != before.worker
    with trio.fail_after(TIMEOUT):
        await completes(server)
    assert await restarts(server) == count + 1
    # The old tree is gone, and nothing of it is left in /dev/shm.
    assert await eventually(lambda: not any(p.alive() for p in before.procs))
    assert in_dev_shm(before.segments) == set()
    assert in_dev_shm(after.segments) == set()
    # Quietly: no traceback from the orphaned worker, no leak warnings from a killed tracker's owner.
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "resource_tracker" not in log, log[-3000:]
    return text


async def _is_up(server: ServerProcess) -> bool:
    return await health(server) == 200


async def test_a_killed_worker_fails_its_streams_and_the_engine_comes_back(restarting: Restarting) -> None:
    text = await kill_and_recover(restarting, "worker")
    assert "worker 0 died (killed by signal 9)" in text


async def test_a_killed_engine_core_fails_its_streams_and_comes_back(restarting: Restarting) -> None:
    text = await kill_and_recover(restarting, "engine")
    assert "the engine process was killed by signal 9" in text


async def test_engine_restart_never_exits_non_zero(tmp_path: Path) -> None:
    server = ServerProcess(
        "never", ["--step-interval-us", "10000", "--engine-restart", "never"], tmp_path / "never.log"
    )
    server.start()
    try:
        await trio.to_thread.run_sync(server.wait_ready, TIMEOUT)
        engine = Proc.of(server.engine_pid)
        with trio.fail_after(TIMEOUT):
            text = await stream_through(server, lambda: os.kill(engine.pid, signal.SIGKILL))
        assert "the engine process was killed by signal 9" in text
        assert text.rstrip().endswith("data: [DONE]")
        assert server.proc is not None
        code = await trio.to_thread.run_sync(server.proc.wait, TIMEOUT)
        assert code == 1, server.log_tail()
        assert "--engine-restart never" in server.log_tail()
        assert not ipc_dirs(server.pid)  # it exited the orderly way
        assert not engine.alive()
    finally:
        server.stop()


async def test_a_killed_api_server_leaves_nothing_a_new_one_would_not_sweep(
    tiny_model: Path, tmp_path: Path
) -> None:
    me = current_owner()
    if me is None:
        pytest.skip("no /proc: IPC folders cannot be checked")
    server = start_model_server(tiny_model, tmp_path, "killed_api")
    tree: Tree | None = None
    sweeper: ServerProcess | None = None
    root = Path(tempfile.gettempdir())
    # Decoys a sweep must leave alone: a live owner's folder (ours), and one with no owner file.
    live = root / f"trioserve-{me.pid}-decoy-live"
    unowned = root / f"trioserve-{me.pid}-decoy-unowned"
    try:
        await trio.to_thread.run_sync(server.wait_ready, TIMEOUT)
        tree = tree_of(server)
        (folder,) = ipc_dirs(server.pid)
        assert Owner.decode((root / folder / "owner").read_text()) == Owner(
            server.pid, Proc.of(server.pid).start_time, me.pid_namespace
        )
        server.signal(signal.SIGKILL)
        assert server.proc is not None
        assert await trio.to_thread.run_sync(server.proc.wait, TIMEOUT) == -signal.SIGKILL
        # The orphans notice and exit by themselves (the engine core polls its parent; the worker
        # follows its engine core), and the segments are gone.
        assert await eventually(lambda: not any(p.alive() for p in tree.procs)), tree
        assert in_dev_shm(tree.segments) == set()
        assert (root / folder).is_dir()  # nothing ran to remove it ...
        live.mkdir()
        (live / "owner").write_text(me.encode())
        unowned.mkdir()
        sweeper = ServerProcess("sweeper", [], tmp_path / "sweeper.log")
        sweeper.start()
        await trio.to_thread.run_sync(sweeper.wait_ready, TIMEOUT)
        assert not (root / folder).exists()  # ... until the next API server started
        assert live.is_dir()
        assert unowned.is_dir()
    finally:
        server.stop()
        if sweeper is not None:
            sweeper.stop()
            assert not sweeper.problems, sweeper.problems
        for path in (live, unowned):
            shutil.rmtree(path, ignore_errors=True)
        if tree is not None:
            leftovers = [p.pid for p in tree.procs if p.kill_if_alive()]
            assert not leftovers, f"orphans still running: {leftovers}"
