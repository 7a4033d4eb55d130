"""A ``trioserve serve --engine mock`` process a test starts and owns (its own flags, rlimits and
lifetime), for tests that signal, starve or stop a server the shared pool must not lose."""

from __future__ import annotations

import http.client
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import free_port


class Server:
    def __init__(self, log_path: Path, *flags: str, fd_limit: int | None = None) -> None:
        self.port = free_port()
        command = [
            sys.executable, "-m", "trioserve", "serve", "--engine", "mock", "--host", "127.0.0.1",
            "--port", str(self.port), "--step-interval-us", "10000", "--shutdown-timeout", "1", *flags,
        ]  # fmt: skip

        def limit() -> None:
            if fd_limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                preexec_fn=limit,  # noqa: PLW1509  (setrlimit only; no locks are taken)
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log()}"
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/health")
                status = conn.getresponse().status
            except OSError:
                status = 0
            finally:
                conn.close()
            if status == 200:
                return
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
