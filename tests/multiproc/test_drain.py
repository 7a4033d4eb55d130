"""SIGTERM with work in flight: what every kind of client sees while the server drains and at the
``--shutdown-timeout`` deadline."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from ._own_server import Server
from ._support import RawHttp, chat_body, http_request, post, sse_chunks

SHUTDOWN_TIMEOUT = 2.0


@pytest.mark.multiproc
async def test_sigterm_refuses_new_work_and_ends_long_streams_properly(tmp_path: Path) -> None:
    server = Server(tmp_path / "drain.log", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
    try:
        server.wait_ready()
        with trio.fail_after(30):
            await _drain_scenario(server)
        assert server.proc.wait(20) == 0, server.log()
    finally:
        server.stop()


async def _drain_scenario(server: Server) -> None:
    port = server.port
    long_body = chat_body(5000, stream=True, ignore_eos=True)  # 50 s at 10 ms a step
    short_body = chat_body(50, stream=True, ignore_eos=True)
    async with (
        await RawHttp.connect("127.0.0.1", port) as long_conn,
        await RawHttp.connect("127.0.0.1", port) as short_conn,
        await RawHttp.connect("127.0.0.1", port) as idle_conn,
        open_websocket_url(f"ws://127.0.0.1:{port}/v1/ws") as ws,
    ):
        await idle_conn.send(http_request("GET", "/v1/models"))
        assert (await idle_conn.read_response()).status == 200  # now an idle keep-alive connection
        await long_conn.send(post("/v1/chat/completions", long_body))
        head = await long_conn.read_head()
        assert head.status == 200 and head.framing == "chunked"
        first = await long_conn.read_chunk()
        await ws.send_message(json.dumps({"type": "request", "id": "w", "body": long_body}))
        assert json.loads(await ws.get_message())["type"] == "chunk"

        request = post("/v1/chat/completions", short_body)
        await short_conn.send(request[:20])  # a request that is still arriving when drain begins
        await trio.sleep(0.1)
        server.proc.send_signal(signal.SIGTERM)
        # At once: no new connections, idle ones closed, new requests on open ones refused.
        assert await idle_conn.at_eof()  # returns once the server has closed it: drain began
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)
        await short_conn.send(request[20:])
        refused = await short_conn.read_response()
        assert refused.status == 503 and refused.header("connection") == "close"
        assert "shutting down" in refused.json()["error"]["message"]

        # At the deadline: an error event, [DONE] and the chunked body's terminator.
        rest = await long_conn.read_body(head)  # raises if the body is cut off
        chunks = sse_chunks(first + rest.body)  # checks the stream ends with [DONE]
        errors = [c for c in chunks if "error" in c]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 503, errors
        assert "shutting down" in errors[0]["error"]["message"]

        # The WebSocket stream gets its error chunk and its final message (as an SSE stream gets an
        # error event and [DONE]), then the socket a close frame with a reason.
        messages = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(await ws.get_message()))
        ws_errors = [m["data"] for m in messages if m["type"] == "chunk" and "error" in m["data"]]
        assert len(ws_errors) == 1 and ws_errors[0]["error"]["code"] == 503, messages[-3:]
        assert messages[-1] == {"type": "done", "id": "w"}
        assert closed.value.reason.code == 1001
        assert closed.value.reason.reason == "the server is shutting down"
