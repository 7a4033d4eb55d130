"""The supervised process tree (docs/processes.md): the formula against the titles found, an API
server killed and restarted while the other serves, an engine core killed while the other serves,
and requests spread over the engines."""

from __future__ import annotations

import collections
import contextlib
import http.client
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from trioserve.runtime.process import rank_title

from ._own_server import Server
from ._support import RawHttp, chat_body, post, proc_children, proc_title, sse_chunks
from .test_model_engine import tiny_model  # noqa: F401  (a fixture)

TIMEOUT = 60


def expected_titles(api: int, dp: int, *, workers: bool, tp: int = 1) -> collections.Counter[str]:
    """docs/processes.md's formula, as titles (``workers``: the model engine's, ``tp`` per engine)."""
    supervised = api > 1 or dp > 1
    titles: list[str] = []
    if supervised:
        titles.append("Supervisor")
    titles += ["APIServer"] if api == 1 else [f"APIServer_{i}" for i in range(api)]
    if dp > 1:
        titles.append("DPCoordinator")
    titles += ["EngineCore"] if dp == 1 else [f"EngineCore_DP{d}" for d in range(dp)]
    if workers:
        titles += [rank_title("Worker", d, dp, t, tp) for d in range(dp) for t in range(tp)]
    return collections.Counter(f"trioserve::{t}" for t in titles)


def tree(pid: int) -> dict[int, str]:
    """``pid`` and every descendant still running: pid -> title (its command line's first word)."""
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            out[current] = proc_title(current)
            todo += proc_children(current)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def trioserve_titles(pid: int) -> collections.Counter[str]:
    return collections.Counter(t for t in tree(pid).values() if t.startswith("trioserve::"))


def helpers(pid: int) -> list[str]:
    """Processes in the tree that are not trioserve's, by command line (docs/processes.md names each
    kind)."""
    out = []
    for child, title in tree(pid).items():
        if not title.startswith("trioserve::"):
            with contextlib.suppress(FileNotFoundError):
                out.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def wait_for(server: Server, done: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``done`` (the tree is another process: there is nothing to wait on but its state)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert server.proc.poll() is None, server.log()
        assert time.monotonic() < deadline, (
            f"{what}: {trioserve_titles(server.proc.pid)}\n{server.log()[-3000:]}"
        )
        time.sleep(0.1)


def wait_titles(server: Server, want: collections.Counter[str], timeout: float = TIMEOUT) -> dict[int, str]:
    wait_for(server, lambda: trioserve_titles(server.proc.pid) == want, f"titles {want}", timeout)
    return tree(server.proc.pid)


def wait_ready_lines(server: Server, count: int) -> None:
    """Every API server logged that it is ready (``/health`` answers from whichever accepts)."""
    wait_for(
        server, lambda: len(re.findall(r"API server \d+ ready", server.log())) >= count, "API servers ready"
    )


@contextmanager
def supervised(tmp_path: Path, name: str, *flags: str) -> Iterator[Server]:
    server = Server(tmp_path / f"{name}.log", *flags)
    try:
        server.wait_ready()
        yield server
    finally:
        pid = server.proc.pid
        left = tree(pid)
        server.stop()
        assert server.proc.returncode == 0, server.log()[-3000:]
        # A library's helper (the resource tracker) exits once its parent has: give it a moment.
        deadline = time.monotonic() + 10
        while (running := [c for c in left if Path(f"/proc/{c}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running == [], f"left running: {[left[c] for c in running]}"


@pytest.mark.parametrize(
    ("flags", "api", "dp"),
    [
        # The other rows: (), in test_process_tree.py; --api-server-count 2 and -dp 2
        # --api-server-count 1, in the fault tests below, which check them first. -dp 2 alone (its API
        # server count defaulting to 2: test_config.py) under -m long.
        pytest.param(("-dp", "2"), 2, 2, marks=pytest.mark.long),
        (("--api-server-count", "3", "-dp", "2"), 3, 2),
    ],
)
def test_the_process_formula_with_the_mock_engine(
    tmp_path: Path, flags: tuple[str, ...], api: int, dp: int
) -> None:
    with supervised(tmp_path, "formula", *flags) as server:
        found = wait_titles(server, expected_titles(api, dp, workers=False))
        role = "Supervisor" if api > 1 or dp > 1 else "APIServer"
        assert found[server.proc.pid] == f"trioserve::{role}"
        assert helpers(server.proc.pid) == []


@pytest.mark.long  # the default run checks the same row through test_prefix_dispatch.py
def test_the_process_formula_with_the_model_engine_on_two_engines(tiny_model: Path, tmp_path: Path) -> None:  # noqa: F811
    flags = ("--engine", "model", str(tiny_model), "--kv-cache-gib", "0.05", "-dp", "2")
    with supervised(tmp_path, "formula_model", *flags) as server:
        wait_titles(server, expected_titles(2, 2, workers=True), timeout=120)
        # The only other processes: one multiprocessing resource tracker per engine core.
        for title in helpers(server.proc.pid):
            assert "multiprocessing.resource_tracker" in title, title
        assert len(helpers(server.proc.pid)) <= 2


def owner_of(client_port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the server end of the TCP connection from ``client_port``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == client_port:
                inodes.add(fields[9])
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return pid
    return None


def pids_titled(server: Server, prefix: str) -> dict[str, int]:
    found = tree(server.proc.pid).items()
    return {t.removeprefix("trioserve::"): p for p, t in found if t.startswith(f"trioserve::{prefix}")}


def metrics(server: Server) -> dict[str, float]:
    """``/metrics`` from whichever API server accepts: sample (name and labels) -> value."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            out[sample] = float(value)
    return out


async def complete(server: Server) -> int:
    async with await RawHttp.connect("127.0.0.1", server.port) as conn:
        await conn.send(post("/v1/completions", {"model": "trioserve-mock", "prompt": "hi", "max_tokens": 4}))
        return (await conn.read_response()).status


async def test_an_api_server_killed_is_restarted_while_the_other_serves(tmp_path: Path) -> None:
    with supervised(tmp_path, "restart", "--api-server-count", "2") as server:
        wait_titles(server, expected_titles(2, 1, workers=False))
        wait_ready_lines(server, 2)
        apis = pids_titled(server, "APIServer")
        with trio.fail_after(TIMEOUT):
            # A long stream; find which API server holds it, and kill that one mid-stream.
            conn = await RawHttp.connect("127.0.0.1", server.port)
            await conn.send(post("/v1/chat/completions", chat_body(6000, stream=True)))
            head = await conn.read_head()
            assert head.status == 200
            await conn.read_chunk()
            port = conn.stream.socket.getsockname()[1]
            victim = owner_of(port, list(apis.values()))
            assert victim is not None
            name = next(n for n, p in apis.items() if p == victim)
            os.kill(victim, signal.SIGKILL)
            with pytest.raises((EOFError, trio.BrokenResourceError)):
                await conn.read_body(head)  # its in-flight request fails
            await conn.aclose()
            # The other keeps serving while the victim is gone (and after).
            for _ in range(5):
                assert await complete(server) == 200
        wait_for(server, lambda: pids_titled(server, "APIServer").get(name) not in (None, victim), "restart")
        assert "starting it again" in server.log()
        wait_ready_lines(server, 3)
        # The engine's output to the dead one queued up to its high-water mark and then waited;
        # its output to the living one never did (engine/output_pump.py's rule).
        assert "stalled" not in server.log()
        # The engine dropped what it still ran for the dead API server (the new one's ClientReset).
        wait_for(server, lambda: "was restarted: dropping its 1 requests" in server.log(), "orphans dropped")
        with trio.fail_after(TIMEOUT):
            for _ in range(5):
                assert await complete(server) == 200
        # Both API servers' accept balance is on /metrics, whichever answers.
        shown = metrics(server)
        for index in (0, 1):
            assert any(
                k.startswith("trioserve:accept_lost_races_total") and f'api_server="{index}"' in k
                for k in shown
            )


async def test_an_engine_core_killed_fails_only_its_requests_and_the_other_serves(tmp_path: Path) -> None:
    with supervised(tmp_path, "dp_fault", "-dp", "2", "--api-server-count", "1") as server:
        wait_titles(server, expected_titles(1, 2, workers=False))
        engines = pids_titled(server, "EngineCore")
        assert set(engines) == {"EngineCore_DP0", "EngineCore_DP1"}
        with trio.fail_after(TIMEOUT):
            # Four long streams over two engines: each engine holds some.
            conns = []
            for _ in range(4):
                conn = await RawHttp.connect("127.0.0.1", server.port)
                await conn.send(post("/v1/chat/completions", chat_body(300, stream=True)))
                head = await conn.read_head()
                assert head.status == 200
                await conn.read_chunk()
                conns.append((conn, head))
            os.kill(engines["EngineCore_DP1"], signal.SIGKILL)
            outcomes = []
            for conn, head in conns:
                body = (await conn.read_body(head)).body
                chunks = sse_chunks(body)
                outcomes.append("error" if any("error" in c for c in chunks) else "done")
                await conn.aclose()
            assert sorted(outcomes) == ["done", "done", "error", "error"], outcomes
            for _ in range(6):  # dispatch skips the dead engine; the pool serves
                assert await complete(server) == 200
        old = engines["EngineCore_DP1"]
        wait_for(
            server,
            lambda: pids_titled(server, "EngineCore_DP1").get("EngineCore_DP1") not in (None, old),
            "restart",
        )
        # Joined again: the supervisor and the API server each log it, as they did at start.
        wait_for(server, lambda: server.log().count("engine 1 ready (mock") >= 4, "engine 1 rejoined")
        with trio.fail_after(TIMEOUT):
            for _ in range(4):
                assert await complete(server) == 200
            # The inventory counts the restart (docs/replicas.md).
            async with await RawHttp.connect("127.0.0.1", server.port) as conn:
                await conn.send(b"GET /v1/replicas HTTP/1.1\r\nhost: x\r\n\r\n")
                inventory = (await conn.read_response()).json()
            assert [r["restarts"] for r in inventory["data"]] == [0, 1], inventory
            assert [r["state"] for r in inventory["data"]] == ["ready", "ready"], inventory
        # The API server follows the DP coordinator (a snapshot at least every second).
        assert (
            sum(
                v for k, v in metrics(server).items() if k.startswith("trioserve:coordinator_snapshots_total")
            )
            > 0
        )
