"""Real ``trioserve serve --engine mock`` processes for the multi-process tests.

Every server the collected tests need is started at once, in parallel, when the first one is asked
for (each costs seconds of imports, and the machine may have two cores). Each waits for
``GET /health`` on its own free port; on teardown it gets SIGTERM (SIGKILL if it does not exit),
and the engine child found at start-up through ``/proc/PID/task/*/children`` must be gone too.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ._support import proc_alive, proc_children, proc_start_time, proc_title

MODEL = "mp-model"
ALIAS = "mp-alias"
MAX_MODEL_LEN = 1024
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0

# Fixture name -> extra ``serve`` flags. Only servers some collected test uses are started.
SERVER_FLAGS: dict[str, list[str]] = {
    # The workhorse: steps as fast as it can, a small context window, two model names.
    # A short drain on SIGTERM keeps teardown quick if a request were ever left in flight.
    "server": [
        "--step-interval-us", "0",
        "--shutdown-timeout", "1",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", MODEL, ALIAS,
    ],
    # 10 ms per step: streams that last long enough to disconnect from or cancel mid-way.
    "slow_server": ["--step-interval-us", "10000"],
    # Owned by test_process_tree: it is SIGTERMed mid-stream.
    "sigterm_server": ["--step-interval-us", "10000"],
    # Owned by test_process_tree: its API server is SIGKILLed.
    "sigkill_server": ["--step-interval-us", "0"],
    # The engine core (scheduler, KV ledger, reference executor) with a pool of 32 blocks of 4 tokens.
    "reference_server": [
        "--engine", "reference", "--block-size", "4", "--num-gpu-blocks-override", "32",
        "--max-num-batched-tokens", "64", "--max-model-len", "256",
    ],
}  # fmt: skip

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.multiproc)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """One ``trioserve serve`` process started by this test session."""

    name: str
    flags: list[str]
    log_path: Path
    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    engine_pid: int = 0
    engine_start_time: str = ""
    ready: bool = False
    terminated_by_pool: bool = False  # the pool sent SIGTERM (a test may have signalled it itself)
    problems: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> None:
        self.port = free_port()
        command = [
            sys.executable, "-m", "trioserve", "serve", "--engine", "mock",
            "--host", self.host, "--port", str(self.port), *self.flags,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def _health(self) -> int | None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError:
            return None
        finally:
            conn.close()

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        if self.ready:
            return
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self._health() != 200:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} not healthy after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)
        children = proc_children(self.pid)
        assert len(children) == 1, f"{self.name}: expected one engine child, found {children}"
        self.engine_pid = children[0]
        start_time = proc_start_time(self.engine_pid)
        assert start_time is not None, f"{self.name}: engine child {self.engine_pid} already gone"
        self.engine_start_time = start_time
        assert proc_title(self.engine_pid) == "trioserve::EngineCore"
        self.ready = True

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def terminate(self) -> None:
        """SIGTERM once (a second one would find trio's handler gone and kill the process)."""
        if self.proc is not None and self.proc.poll() is None and not self.terminated_by_pool:
            self.terminated_by_pool = True
            self.proc.send_signal(signal.SIGTERM)

    def engine_alive(self) -> bool:
        return bool(self.engine_pid) and proc_alive(self.engine_pid, self.engine_start_time)

    def wait_engine_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.engine_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; record (not raise) anything that went wrong."""
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.problems.append(f"{self.name}: did not exit within {STOP_TIMEOUT:.0f} s of SIGTERM")
            self.proc.kill()
            self.proc.wait()
        else:
            if self.terminated_by_pool and self.proc.returncode != 0:
                self.problems.append(f"{self.name}: exited with {self.proc.returncode} after SIGTERM")
        if self.engine_pid and not self.wait_engine_gone(10.0):
            self.problems.append(f"{self.name}: engine child {self.engine_pid} outlived its API server")
            if self.engine_alive():  # still the same process: it is ours to clean up
                os.kill(self.engine_pid, signal.SIGKILL)


class ServerPool:
    def __init__(self, servers: dict[str, ServerProcess]) -> None:
        self.servers = servers

    def get(self, name: str) -> ServerProcess:
        server = self.servers.get(name)
        if server is None:  # not foreseen at collection time (e.g. requested dynamically)
            server = self.servers[name] = ServerProcess(
                name, SERVER_FLAGS[name], next(iter(self.servers.values())).log_path.parent / f"{name}.log"
            )
            server.start()
        server.wait_ready()
        return server


@pytest.fixture(scope="session")
def server_pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool]:
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    names = [name for name in SERVER_FLAGS if name in wanted] or ["server"]
    log_dir = tmp_path_factory.mktemp("trioserve-logs")
    servers = {name: ServerProcess(name, SERVER_FLAGS[name], log_dir / f"{name}.log") for name in names}
    try:
        for server in servers.values():
            server.start()
        yield ServerPool(servers)
    finally:
        for server in servers.values():  # all at once: SIGTERM everyone, then wait for each
            server.terminate()
        for server in servers.values():
            server.stop()
    problems = [p for server in servers.values() for p in server.problems]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def server(server_pool: ServerPool) -> ServerProcess:
    """The default server: step interval 0, max-model-len 1024, names mp-model and mp-alias."""
    return server_pool.get("server")


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture(scope="session")
def slow_server(server_pool: ServerPool) -> ServerProcess:
    """A server whose mock engine steps every 10 ms."""
    return server_pool.get("slow_server")


@pytest.fixture(scope="session")
def sigterm_server(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("sigterm_server")


@pytest.fixture(scope="session")
def sigkill_server(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("sigkill_server")


@pytest.fixture(scope="session")
def reference_server(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("reference_server")
