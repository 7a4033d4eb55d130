"""Engines on another host (docs/remote_engines.md), across two network namespaces joined by a veth
pair: the API side (supervisor, API server, one local engine) in one, a headless engine host in the
other, over TCP with the engine secret (ZMQ CURVE). A wrong secret never joins.

The namespaces are created and removed here; without the privilege to create them (``ip netns add``
needs CAP_SYS_ADMIN) the tests skip and say so.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TIMEOUT = 60


@dataclass(frozen=True)
class Hosts:
    api: str  # namespace names
    engine: str
    api_ip: str
    engine_ip: str


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    api, engine = f"tsv_a{tag}", f"tsv_e{tag}"
    net = f"10.{200 + random.randrange(50)}.{random.randrange(250)}"
    made = _ip("netns", "add", api)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here ({made.stderr.strip()}): needs CAP_SYS_ADMIN")
    try:
        steps = [
            ("netns", "add", engine),
            ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"ve{tag}"),
            ("link", "set", f"va{tag}", "netns", api),
            ("link", "set", f"ve{tag}", "netns", engine),
            ("-n", api, "addr", "add", f"{net}.1/24", "dev", f"va{tag}"),
            ("-n", engine, "addr", "add", f"{net}.2/24", "dev", f"ve{tag}"),
            ("-n", api, "link", "set", f"va{tag}", "up"),
            ("-n", engine, "link", "set", f"ve{tag}", "up"),
            ("-n", api, "link", "set", "lo", "up"),
            ("-n", engine, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(
                    f"cannot set up the namespaces' link (ip {' '.join(step)}: {done.stderr.strip()})"
                )
        yield Hosts(api, engine, f"{net}.1", f"{net}.2")
    finally:
        _ip("netns", "del", api)  # removing a namespace removes its end of the veth pair, and so both
        _ip("netns", "del", engine)


class Proc:
    """A trioserve process in a namespace, its secret in its environment (never on its command line)."""

    def __init__(self, namespace: str, log: Path, args: list[str], secret: str) -> None:
        self.log_path = log
        env = dict(os.environ, PYTHONUNBUFFERED="1", TRIOSERVE_ENGINE_SECRET=secret)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, "-m", "trioserve", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.proc.poll() is None, self.log()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def complete(hosts: Hosts) -> dict[str, object]:
    """One completion from inside the API host's namespace (its HTTP port is local to it)."""
    body = json.dumps({"model": "trioserve-mock", "prompt": "hi", "max_tokens": 3})
    done = subprocess.run(
        ["ip", "netns", "exec", hosts.api, "curl", "-s", "-m", "10", "http://127.0.0.1:8000/v1/completions",
         "-H", "content-type: application/json", "-d", body],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reply: dict[str, object] = json.loads(done.stdout)
    return reply


def api_side(hosts: Hosts, tmp_path: Path) -> Proc:
    return Proc(
        hosts.api,
        tmp_path / "api.log",
        ["serve", "--engine", "mock", "--port", "8000", "-dp", "2", "--data-parallel-size-local", "1",
         "--api-server-count", "1", "--handshake-address", f"tcp://{hosts.api_ip}:7100",
         "--step-interval-us", "2000", "--shutdown-timeout", "1"],
        "the right secret",
    )  # fmt: skip


def engine_host(hosts: Hosts, tmp_path: Path, secret: str, name: str) -> Proc:
    return Proc(
        hosts.engine,
        tmp_path / f"{name}.log",
        ["engine-core", "--headless", "--engine", "mock", "-dp", "2", "--data-parallel-start-rank", "1",
         "--handshake-address", f"tcp://{hosts.api_ip}:7100", "--step-interval-us", "2000"],
        secret,
    )  # fmt: skip


@pytest.mark.long  # the wrong-secret test below ends with the right engine joining and serving
def test_an_engine_on_another_host_joins_over_tcp_and_serves(hosts: Hosts, tmp_path: Path) -> None:
    api = api_side(hosts, tmp_path)
    remote = engine_host(hosts, tmp_path, "the right secret", "engine_host")
    try:
        api.wait_log("API server 0 ready")
        remote.wait_log("engine core 1 ready")
        assert "engine 1 ready (mock" in api.log()
        for _ in range(6):
            reply = complete(hosts)
            assert reply["choices"], reply
        # No secret on any command line of the API host's processes or the engine host's.
        for pid in (api.proc.pid, remote.proc.pid):
            assert b"the right secret" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        assert api.stop() == 0, api.log()[-3000:]
        remote.stop()


def test_an_engine_with_a_wrong_secret_never_joins(hosts: Hosts, tmp_path: Path) -> None:
    api = api_side(hosts, tmp_path)
    intruder = engine_host(hosts, tmp_path, "a wrong secret", "intruder")
    try:
        intruder.wait_log("engine rank 1 started")
        # Both sides say why, and it never joins.
        intruder.wait_log("refused this engine's CURVE handshake")
        api.wait_log("failed their CURVE handshake")
        time.sleep(3)
        assert "engine 1 ready" not in api.log()
        assert "engine core 1 ready" not in intruder.log()
    finally:
        intruder.stop()
    # The right one, started next, joins.
    remote = engine_host(hosts, tmp_path, "the right secret", "engine_host")
    try:
        api.wait_log("engine 1 ready (mock")
        api.wait_log("API server 0 ready")
        for _ in range(4):
            assert complete(hosts)["choices"]
        # No secret on any command line of the API host's processes or the engine host's.
        for pid in (api.proc.pid, remote.proc.pid):
            assert b"the right secret" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        assert api.stop() == 0, api.log()[-3000:]
        remote.stop()


def test_a_tcp_handshake_without_a_secret_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trioserve", "serve", "--engine", "mock", "--port", "0", "-dp", "2",
         "--handshake-address", "tcp://127.0.0.1:7100"],
        capture_output=True, text=True, timeout=60, check=False,
        env={k: v for k, v in os.environ.items() if k != "TRIOSERVE_ENGINE_SECRET"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "--engine-secret" in done.stderr
