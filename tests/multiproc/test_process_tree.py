"""The process tree: titles, graceful SIGTERM, an engine that follows its API server, bad flags."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

import pytest
import trio

from ._support import RawHttp, chat_body, ipc_dirs, post, proc_children, proc_title, sse_chunks, summarize
from .conftest import ServerProcess

TIMEOUT = 30


async def wait_exit(server: ServerProcess, timeout: float = TIMEOUT) -> int:
    assert server.proc is not None
    return await trio.to_thread.run_sync(server.proc.wait, timeout)


async def wait_engine_gone(server: ServerProcess, timeout: float = TIMEOUT) -> None:
    gone = await trio.to_thread.run_sync(server.wait_engine_gone, timeout)
    assert gone, f"engine {server.engine_pid} still running {timeout:.0f} s after its API server exited"


def test_process_titles(server: ServerProcess) -> None:
    assert proc_title(server.pid) == "trioserve::APIServer"
    children = proc_children(server.pid)
    assert children == [server.engine_pid]
    assert proc_title(server.engine_pid) == "trioserve::EngineCore"
    assert ipc_dirs(server.pid), "the API server's IPC folder exists while it runs"


async def test_sigterm_drains_in_flight_stream_and_leaves_nothing(sigterm_server: ServerProcess) -> None:
    server = sigterm_server
    pid = server.pid
    assert ipc_dirs(pid)
    with trio.fail_after(TIMEOUT):
        async with await RawHttp.connect(server.host, server.port) as conn:
            # 40 tokens at 10 ms per step; SIGTERM arrives after the first of them.
            await conn.send(post("/v1/chat/completions", chat_body(40, stream=True, return_token_ids=True)))
            head = await conn.read_head()
            assert head.status == 200
            assert head.framing == "chunked"
            first = await conn.read_chunk()
            assert first.startswith(b"data: ")
            server.signal(signal.SIGTERM)
            rest = await conn.read_body(head)
    s = summarize(sse_chunks(first + rest.body))  # ends with [DONE]: the stream was not cut off
    assert len(s.token_ids[0]) == 40
    assert s.finish == {0: "length"}
    assert await wait_exit(server) == 0
    await wait_engine_gone(server)
    assert not ipc_dirs(pid), "the IPC folder was not removed"


async def test_engine_exits_when_api_server_is_killed(sigkill_server: ServerProcess) -> None:
    server = sigkill_server
    assert server.engine_alive()
    server.signal(signal.SIGKILL)
    assert await wait_exit(server) == -signal.SIGKILL
    await wait_engine_gone(server)  # the engine notices it was orphaned and exits by itself
    for name in ipc_dirs(server.pid):  # a killed server cannot remove its IPC folder; we do
        shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)


@pytest.mark.parametrize(
    "flags",
    [
        ["--port", "notaport"],
        ["--bogus"],
        ["--port", "70000"],
        ["--max-model-len", "0"],
        ["--step-interval-us", "-1"],
        ["--engine", "warp-drive"],
    ],
    ids=" ".join,
)
async def test_bad_flag_exits_2_with_one_line(flags: list[str]) -> None:
    command = [sys.executable, "-m", "trioserve", "serve", "--engine", "mock", *flags]
    if "--engine" in flags:
        command = [sys.executable, "-m", "trioserve", "serve", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with trio.fail_after(TIMEOUT):
        result = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False, env=env
        )
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert result.stdout == b""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("trioserve"), stderr
    assert "error" in lines[0]
    assert "Traceback" not in stderr
