"""A SIGSTOPped worker with streams running is visible at once, long before ``--worker-step-timeout``
(issue 11 item 5), with ``serve --engine model`` on a tiny random Llama.

The engine core's busy loop waits on the stopped worker's forward; its heartbeats go on, and once
the step has run past the engine core's bound for it (the 3 s floor: the tiny model's steps take
milliseconds) they say it is overdue: ``/health`` 503 naming the engine, new requests refused with
503 + ``Retry-After``. After SIGCONT the forward returns and everything goes on. (The step timeout, 300 s by
default, would then fail the engine as before: ``test_model_engine.py`` covers that.) Deadlines are
hang guards, not timing assertions.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from ._support import RawHttp, RawResponse, post, request_json, sse_chunks, summarize
from .test_engine_stall import GUARD, health, wait_health
from .test_model_engine import TIMEOUT, start_model_server, tiny_model, workers_of

__all__ = ["tiny_model"]  # the module fixture, shared with test_model_engine.py

STREAMS = 8
TOKENS = 200


async def test_a_sigstopped_worker_is_reported_and_refused_then_recovers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    server = start_model_server(tiny_model, tmp_path_factory.mktemp("logs"), "stopped_worker")
    worker = 0
    try:
        await trio.to_thread.run_sync(server.wait_ready, TIMEOUT)
        (worker,) = workers_of(server)  # the engine core's child, by PID
        assert (await health(server))[0] == 200
        conns: list[tuple[RawHttp, bytes]] = []
        with trio.fail_after(GUARD):
            for _ in range(STREAMS):
                conn = await RawHttp.connect(server.host, server.port)
                body = {"prompt": "x", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
                await conn.send(post("/v1/completions", {**body, "return_token_ids": True}))
                head = await conn.read_head()
                assert head.status == 200
                conns.append((conn, await conn.read_chunk()))  # it streams
        os.kill(worker, signal.SIGSTOP)
        _, text, took = await wait_health(server, 503)
        assert "engine 0 is stalled: its step of" in text, text  # told by the engine core: it runs
        print(f"worker stopped: /health 503 after {took:.1f} s")
        with trio.fail_after(GUARD):
            status, refused = await request_json(
                server.host, server.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}
            )
        assert status == 503 and "engine 0 is stalled" in refused["error"]["message"]
        os.kill(worker, signal.SIGCONT)
        await wait_health(server, 200)
        with trio.fail_after(GUARD):
            for conn, start in conns:
                # The rest of the chunked body whose head and first chunk were read above.
                rest = await conn.read_body(RawResponse("HTTP/1.1", 200, "OK", [], framing="chunked"))
                await conn.aclose()
                ids = summarize(sse_chunks(start + rest.body)).token_ids[0]
                assert len(ids) == TOKENS
            status, _ = await request_json(
                server.host, server.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}
            )
        assert status == 200
    finally:
        if worker:
            os.kill(worker, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        server.stop()
    assert not server.problems, server.problems
