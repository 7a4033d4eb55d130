"""A stopped engine core is visible to ``/health`` and to admission (issue 11 item 5), for real.

A ``trioserve serve --engine mock`` of its own (it gets SIGSTOPped, so it is not the shared pool's):
its engine-core process is found as the API server's child by PID, stopped with SIGSTOP, first with
streams running, then while idle; ``/health`` must turn 503 naming the engine and a new request must
be refused with 503 + ``Retry-After`` instead of hanging. After SIGCONT both recover and the streams
that waited run to their end. Every process is stopped by PID at the end.

The deadlines below are hang guards, not timing assertions: the stall bound is 3 s of silence here
(the floor: 10 ms steps), so 503 is expected about 3 s after the SIGSTOP.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import trio

from ._support import (
    RawHttp,
    assert_openai_error,
    chat_body,
    http_request,
    post,
    proc_children,
    proc_start_time,
    request_json,
)
from .conftest import ServerProcess

CHAT = "/v1/chat/completions"
STREAMS = 8
GUARD = 30.0  # seconds: far beyond the 3 s bound; only a hang reaches it


async def health(server: ServerProcess) -> tuple[int, str]:
    async with await RawHttp.connect(server.host, server.port) as conn:
        await conn.send(http_request("GET", "/health", headers=[("Connection", "close")]))
        response = await conn.read_response()
    return response.status, response.body.decode()


async def wait_health(server: ServerProcess, status: int) -> tuple[int, str, float]:
    """Poll ``/health`` until it answers ``status``; returns it with the seconds that took."""
    start = time.monotonic()
    with trio.fail_after(GUARD):
        while True:
            got, body = await health(server)
            if got == status:
                return got, body, time.monotonic() - start
            await trio.sleep(0.1)


async def refused_fast(server: ServerProcess) -> float:
    """A new request is refused with 503 + Retry-After; returns how long the answer took."""
    start = time.monotonic()
    with trio.fail_after(GUARD):
        async with await RawHttp.connect(server.host, server.port) as conn:
            await conn.send(post(CHAT, chat_body(4), headers=[("Connection", "close")]))
            response = await conn.read_response()
    assert response.status == 503, response.body
    assert response.header("retry-after") == "1"
    error = assert_openai_error(response.json(), 503)
    assert "engine 0 is stalled" in error["message"]
    return time.monotonic() - start


async def open_stream(server: ServerProcess) -> tuple[RawHttp, bytes]:
    conn = await RawHttp.connect(server.host, server.port)
    await conn.send(post(CHAT, chat_body(600, stream=True, return_token_ids=True)))
    head = await conn.read_head()
    assert head.status == 200 and head.framing == "chunked"
    # The role chunk and two tokens: it is streaming.
    return conn, b"".join([await conn.read_chunk() for _ in range(3)])


async def finish_stream(conn: RawHttp, body: bytes) -> list[int]:
    """The token ids of the whole stream (``body``: what was read of it already)."""
    while chunk := await conn.read_chunk():
        body += chunk
    await conn.aclose()
    ids: list[int] = []
    for event in body.decode().split("\n\n"):
        data = event.removeprefix("data: ")
        if data and data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                ids += choice.get("token_ids") or []
    return ids


async def test_sigstopped_engine_core_is_reported_and_refused_then_recovers(tmp_path: Path) -> None:
    server = ServerProcess("stall_server", ["--step-interval-us", "10000"], tmp_path / "stall_server.log")
    server.start()
    engine_pid = 0
    try:
        server.wait_ready()
        engine_pid = server.engine_pid  # the API server's only child, found by PID in /proc
        assert (await health(server))[0] == 200

        # ---- stopped with streams running: clients get silence -----------------------------------
        streams = [await open_stream(server) for _ in range(STREAMS)]
        os.kill(engine_pid, signal.SIGSTOP)
        _, body, took = await wait_health(server, 503)
        assert "engine 0 is stalled" in body, body
        print(f"busy engine stopped: /health 503 after {took:.1f} s")
        print(f"new request refused in {await refused_fast(server) * 1e3:.0f} ms")
        status, metrics = await request_json(server.host, server.port, "GET", "/health")
        assert status == 503 and metrics is not None
        os.kill(engine_pid, signal.SIGCONT)
        _, _, took = await wait_health(server, 200)
        print(f"after SIGCONT: /health 200 in {took:.1f} s")
        with trio.fail_after(GUARD):
            for conn, start in streams:  # the streams that waited go on to their end
                assert len(await finish_stream(conn, start)) == 600
            status, reply = await request_json(server.host, server.port, "POST", CHAT, chat_body(4))
        assert status == 200, reply

        # ---- stopped while idle: its heartbeat stops ---------------------------------------------
        await trio.sleep(1.0)
        assert (await health(server))[0] == 200
        os.kill(engine_pid, signal.SIGSTOP)
        _, body, took = await wait_health(server, 503)
        assert "engine 0 is stalled" in body, body
        print(f"idle engine stopped: /health 503 after {took:.1f} s")
        await refused_fast(server)
        os.kill(engine_pid, signal.SIGCONT)
        await wait_health(server, 200)
        with trio.fail_after(GUARD):
            status, reply = await request_json(server.host, server.port, "POST", CHAT, chat_body(4))
        assert status == 200, reply
        log = server.log_path.read_text()
        assert "engine 0 stalled" in log and "engine 0 resumed" in log
    finally:
        if engine_pid and server.engine_alive():
            os.kill(engine_pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        server.stop()  # SIGTERM to the API server by PID (SIGKILL if needed), engine child checked
    assert not server.problems, server.problems


async def test_an_engine_core_stopped_past_the_hard_bound_is_killed_and_replaced(tmp_path: Path) -> None:
    """``--worker-step-timeout`` is the hard bound for a silent engine core too: the API server kills
    it, its streams end with an error event, and a new engine core serves."""
    flags = ["--step-interval-us", "10000", "--worker-step-timeout", "6"]
    server = ServerProcess("stall_kill_server", flags, tmp_path / "stall_kill_server.log")
    server.start()
    try:
        server.wait_ready()
        stopped = server.engine_pid
        conn, start = await open_stream(server)
        os.kill(stopped, signal.SIGSTOP)
        with trio.fail_after(GUARD):
            body = start
            while chunk := await conn.read_chunk():
                body += chunk
        await conn.aclose()
        assert b'"code":503' in body and body.endswith(b"data: [DONE]\n\n"), body[-300:]
        await wait_health(server, 200)  # the replacement joined
        with trio.fail_after(GUARD):
            status, reply = await request_json(server.host, server.port, "POST", CHAT, chat_body(4))
        assert status == 200, reply
        log = server.log_path.read_text()
        assert "has sent nothing for" in log and "killing it" in log, log[-2000:]
        children = [p for p in proc_children(server.pid) if p != stopped]
        assert len(children) == 1
        server.engine_pid = children[0]  # the pool's checks follow the live engine
        server.engine_start_time = proc_start_time(children[0]) or ""
    finally:
        server.stop()
    assert not server.problems, server.problems
