"""Replica health with real processes (docs/replicas.md): two mock replicas, one hung by SIGSTOP.

Requests carry a short ``timeout_ms``. The hung replica's requests end with 504; its replica is backed
off, then ejected after three timeouts in a row (the log line, ``GET /v1/replicas``, ``/metrics``);
traffic flows to the other; after SIGCONT a probe answers and readmits it at once. The stopped engine
core also stops heartbeating, but its stall is only noticed seconds later (the engine's stall bound):
the deadline catches it first, and would as well for a forward that hangs while heartbeats flow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import trio

from ._own_server import Server
from ._support import RawHttp, chat_body, post
from .test_scale_out import (
    TIMEOUT,
    expected_titles,
    metrics,
    pids_titled,
    supervised,
    wait_for,
    wait_titles,
)


async def _complete(port: int, timeout_ms: int | None = None) -> int:
    body: dict[str, object] = {"model": "trioserve-mock", "prompt": "hi", "max_tokens": 4}
    if timeout_ms is not None:
        body["timeout_ms"] = timeout_ms
    async with await RawHttp.connect("127.0.0.1", port) as conn:
        await conn.send(post("/v1/completions", body))
        response = await conn.read_response()
        if response.status == 504:
            error = json.loads(response.body)["error"]
            assert error["type"] == "GatewayTimeoutError", error
            assert "no output within" in error["message"], error
        return response.status


async def _inventory(port: int) -> dict[str, object]:
    async with await RawHttp.connect("127.0.0.1", port) as conn:
        await conn.send(b"GET /v1/replicas HTTP/1.1\r\nhost: x\r\n\r\n")
        response = await conn.read_response()
        assert response.status == 200, response.body
        value: dict[str, object] = json.loads(response.body)
        return value


def _metric(server: Server, name: str) -> float:
    """``name``'s value on /metrics, summed over its labels (one API server here)."""
    return sum(v for k, v in metrics(server).items() if k.partition("{")[0] == name)


def _state(inventory: dict[str, object], index: int) -> str:
    data = inventory["data"]
    assert isinstance(data, list)
    return str(data[index]["state"])


async def test_a_hung_replica_is_backed_off_ejected_and_readmitted(tmp_path: Path) -> None:
    flags = ("-dp", "2", "--api-server-count", "1", "--base-ejection-ms", "60000")
    with supervised(tmp_path, "hung_replica", *flags) as server:
        wait_titles(server, expected_titles(1, 2, workers=False))
        engines = pids_titled(server, "EngineCore")
        with trio.fail_after(TIMEOUT):
            for _ in range(4):  # both replicas answer
                assert await _complete(server.port, 2000) == 200
            inventory = await _inventory(server.port)
            assert inventory["desired"] == 2 and inventory["ready"] == 2
            assert [_state(inventory, i) for i in (0, 1)] == ["ready", "ready"]

            os.kill(engines["EngineCore_DP1"], signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                statuses: list[int] = []
                while "replica_ejected replica=1" not in server.log():
                    assert len(statuses) < 200, (statuses, server.log()[-3000:])
                    statuses.append(await _complete(server.port, 300))
                took = time.monotonic() - stopped
                print(f"ejected {took:.1f} s after SIGSTOP; statuses {statuses}")
                assert statuses.count(504) == 3, statuses  # three in a row on replica 1, no more
                assert set(statuses) == {200, 504}
                inventory = await _inventory(server.port)
                assert _state(inventory, 1) == "ejected", inventory
                assert _state(inventory, 0) == "ready", inventory
                assert _metric(server, "trioserve:replica_ejections_total") == 1
                assert _metric(server, "trioserve:request_timeouts_total") == 3
                assert _metric(server, "trioserve:replicas_ejected") == 1
                # Ejected: every request goes to the other replica and succeeds.
                for _ in range(20):
                    assert await _complete(server.port, 300) == 200
            finally:
                os.kill(engines["EngineCore_DP1"], signal.SIGCONT)
            resumed = time.monotonic()
            # The next probe (at most a backoff's 3.2 s away, plus its own deadline) answers.
            readmitted = "replica_readmitted replica=1 reason=answered"
            wait_for(server, lambda: readmitted in server.log(), "readmit")
            print(f"readmitted {time.monotonic() - resumed:.1f} s after SIGCONT")
            inventory = await _inventory(server.port)
            assert _state(inventory, 1) == "ready", inventory
            assert _metric(server, "trioserve:replica_readmissions_total") == 1
            assert _metric(server, "trioserve:replicas_ejected") == 0
            ejected = r"replica_ejected replica=1 reason=consecutive_timeouts duration_s=60\b"
            assert re.search(ejected, server.log())
            for _ in range(8):  # both serve again
                assert await _complete(server.port, 2000) == 200


async def test_least_outstanding_bytes_caps_each_replica_across_api_servers(tmp_path: Path) -> None:
    """Two API servers, two replicas, two in flight per replica: the fifth concurrent stream is
    refused at once with 503 and Retry-After, whichever API server took it; the inventory counts
    every API server's requests; once streams end there is room again."""
    flags = ("-dp", "2", "--api-server-count", "2", "--dispatch", "least-outstanding-bytes")
    with supervised(tmp_path, "lob", *flags, "--max-inflight-per-replica", "2") as server:
        wait_titles(server, expected_titles(2, 2, workers=False))
        with trio.fail_after(TIMEOUT):
            streams = []
            for _ in range(4):  # long streams: they hold their slots until closed
                conn = await RawHttp.connect("127.0.0.1", server.port)
                await conn.send(post("/v1/chat/completions", chat_body(5000, stream=True)))
                head = await conn.read_head()
                assert head.status == 200
                await conn.read_chunk()
                streams.append(conn)
            inventory = await _inventory(server.port)
            data = inventory["data"]
            assert isinstance(data, list)
            assert [entry["in_flight"] for entry in data] == [2, 2], inventory
            assert all(int(entry["outstanding_bytes"]) > 0 for entry in data), inventory
            for _ in range(4):  # every replica is full: refused at once, by either API server
                async with await RawHttp.connect("127.0.0.1", server.port) as conn:
                    await conn.send(post("/v1/chat/completions", chat_body(4)))
                    response = await conn.read_response()
                    assert response.status == 503, response.body
                    assert response.header("retry-after") == "1", response.headers
                    assert b"requests in flight" in response.body
            await streams.pop().aclose()  # the client goes away: its slot is released

            async def room() -> bool:
                async with await RawHttp.connect("127.0.0.1", server.port) as conn:
                    await conn.send(post("/v1/chat/completions", chat_body(4)))
                    return (await conn.read_response()).status == 200

            for _ in range(200):  # the cancel reaches the API server a moment later
                if await room():
                    break
                await trio.sleep(0.05)
            else:
                raise AssertionError(f"no room after a stream closed: {await _inventory(server.port)}")
            for conn in streams:
                await conn.aclose()
