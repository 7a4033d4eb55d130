"""The WebSocket route ``/v1/ws``: several requests multiplexed over one socket.

Client -> server: ``{"type":"request","id","endpoint","body"}`` and ``{"type":"cancel","id"}``.
Server -> client: ``chunk`` (the SSE chunk JSON as ``data``) ... ``done`` for a streamed request,
one ``response`` for a non-streamed one, ``error`` (with ``status``) on failure. Every request gets
exactly one final message; a cancelled one gets ``done``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url, wrap_client_stream

from ._support import (
    CHAT_MESSAGES,
    RawHttp,
    assert_openai_error,
    chat_body,
    http_request,
    post,
    request_json,
    summarize,
)
from .conftest import MODEL, ServerProcess

TIMEOUT = 30
FINAL = ("done", "response", "error")


@dataclass
class Tracked:
    """Everything one request id received, in order."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    finals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final(self) -> dict[str, Any]:
        assert len(self.finals) == 1, f"expected one final message, got {self.finals}"
        return self.finals[0]


class WsSession:
    def __init__(self, ws: WebSocketConnection, *, strict: bool = True) -> None:
        self.ws = ws
        self.strict = strict  # no chunk may follow an id's final message (off: ids reused on purpose)
        self.seen: dict[str | None, Tracked] = {}
        self.log: list[dict[str, Any]] = []
        self._sentinels = 0

    async def request(self, rid: str, body: dict[str, Any], endpoint: str = "chat.completions") -> None:
        message = {"type": "request", "id": rid, "endpoint": endpoint, "body": body}
        await self.ws.send_message(json.dumps(message))

    async def cancel(self, rid: str) -> None:
        await self.ws.send_message(json.dumps({"type": "cancel", "id": rid}))

    async def next(self) -> dict[str, Any]:
        raw = await self.ws.get_message()
        assert isinstance(raw, str), "the server sends text messages"
        message = json.loads(raw)
        self.log.append(message)
        tracked = self.seen.setdefault(message.get("id"), Tracked())
        if message["type"] == "chunk":
            if self.strict:
                assert not tracked.finals, f"chunk after the final message for {message['id']!r}"
            tracked.chunks.append(message["data"])
        else:
            assert message["type"] in FINAL, message
            tracked.finals.append(message)
        return message

    async def until_final(self, *rids: str) -> None:
        """Read until every id in ``rids`` has its final message."""
        while not all(self.seen.get(r) and self.seen[r].finals for r in rids):
            await self.next()

    async def settle(self) -> None:
        """Round-trip a sentinel request: the server's outbox is FIFO, so any message already due
        (a duplicate final, a stray chunk) arrives before the sentinel's response."""
        self._sentinels += 1
        rid = f"sentinel-{self._sentinels}"
        await self.request(rid, {"messages": CHAT_MESSAGES, "max_tokens": 1})
        await self.until_final(rid)
        assert self.seen.pop(rid).final["type"] == "response"


@asynccontextmanager
async def ws_session(server: ServerProcess, *, strict: bool = True) -> AsyncIterator[WsSession]:
    async with open_websocket_url(f"ws://{server.host}:{server.port}/v1/ws") as ws:
        yield WsSession(ws, strict=strict)


def token_count(tracked: Tracked) -> int:
    return sum(len(ids) for ids in summarize(tracked.chunks).token_ids.values())


async def test_two_concurrent_streams(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            usage = {"include_usage": True}
            await s.request("a", chat_body(7, stream=True, return_token_ids=True, stream_options=usage))
            completion = {"prompt": "hi", "max_tokens": 11, "stream": True, "return_token_ids": True}
            await s.request("b", {**completion, "ignore_eos": True}, endpoint="completions")
            await s.until_final("a", "b")
            await s.settle()
    a, b = s.seen["a"], s.seen["b"]
    assert a.final["type"] == "done"
    assert b.final["type"] == "done"
    sa, sb = summarize(a.chunks), summarize(b.chunks)
    assert len(sa.ids) == 1
    assert len(sb.ids) == 1
    assert sa.ids != sb.ids
    assert sa.objects == {"chat.completion.chunk"}
    assert sb.objects == {"text_completion"}
    assert sa.roles == {0: "assistant"}
    assert token_count(a) == 7
    assert token_count(b) == 11
    assert sa.finish == {0: "length"}
    assert sb.finish == {0: "length"}
    assert sa.usage is not None
    assert sa.usage["completion_tokens"] == 7
    assert sb.usage is None
    assert set(s.seen) == {"a", "b"}


async def test_many_concurrent_requests(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            for i in range(12):
                await s.request(f"r{i}", chat_body(3 + i, stream=i % 2 == 0, return_token_ids=True))
            await s.until_final(*(f"r{i}" for i in range(12)))
            await s.settle()
    for i in range(12):
        tracked = s.seen[f"r{i}"]
        if i % 2 == 0:
            assert tracked.final["type"] == "done"
            assert token_count(tracked) == 3 + i
        else:
            assert tracked.final["type"] == "response"
            assert tracked.chunks == []
            assert tracked.final["data"]["usage"]["completion_tokens"] == 3 + i


async def test_cancel_mid_stream(slow_server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(slow_server) as s:
            # 10 ms per step: "long" would take 20 s, "short" about 0.4 s.
            await s.request("long", chat_body(2000, stream=True, return_token_ids=True))
            await s.request("short", chat_body(40, stream=True, return_token_ids=True))
            while token_count(s.seen.get("long") or Tracked()) < 2:
                await s.next()
            await s.cancel("long")
            await s.until_final("long", "short")
            await s.settle()
            assert s.seen["long"].final["type"] == "done"
            assert token_count(s.seen["long"]) < 2000
            assert s.seen["short"].final["type"] == "done"
            assert token_count(s.seen["short"]) == 40
            # The id is free again once its request has ended.
            await s.request("long", chat_body(3, stream=True, return_token_ids=True))
            s.seen.pop("long")
            await s.until_final("long")
            assert token_count(s.seen["long"]) == 3


async def test_cancel_unknown_or_finished_id_is_ignored(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            await s.cancel("never-sent")
            await s.request("x", chat_body(2, stream=True))
            await s.until_final("x")
            await s.cancel("x")
            await s.request("y", chat_body(2))
            await s.until_final("y")
            await s.settle()
    assert s.seen["x"].final["type"] == "done"
    assert s.seen["y"].final["type"] == "response"
    assert set(s.seen) == {"x", "y"}


async def test_non_streamed_request_gets_one_response(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            await s.request("full", chat_body(5, n=2, return_token_ids=True))
            await s.until_final("full")
            await s.settle()
    tracked = s.seen["full"]
    assert tracked.chunks == []
    final = tracked.final
    assert final["type"] == "response"
    body = final["data"]
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert all(len(c["token_ids"]) == 5 for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 10
    status, tok = await request_json(
        server.host, server.port, "POST", "/tokenize", {"messages": CHAT_MESSAGES}
    )
    assert status == 200
    assert body["usage"]["prompt_tokens"] == tok["count"]


async def test_ws_matches_http_for_a_seed(server: ServerProcess) -> None:
    body = chat_body(9, seed=777, return_token_ids=True)
    status, http_body = await request_json(server.host, server.port, "POST", "/v1/chat/completions", body)
    assert status == 200
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            await s.request("full", body)
            await s.request("streamed", {**body, "stream": True})
            await s.until_final("full", "streamed")
    ws_choice = s.seen["full"].final["data"]["choices"][0]
    http_choice = http_body["choices"][0]
    assert ws_choice["token_ids"] == http_choice["token_ids"]
    assert ws_choice["message"] == http_choice["message"]
    streamed = summarize(s.seen["streamed"].chunks)
    assert streamed.token_ids[0] == http_choice["token_ids"]
    assert streamed.texts[0] == http_choice["message"]["content"]


@pytest.mark.parametrize(
    ("body", "endpoint", "status"),
    [
        ({"max_tokens": 2}, "chat.completions", 400),
        ({"messages": [], "max_tokens": 2}, "chat.completions", 400),
        ({"messages": CHAT_MESSAGES, "max_tokens": -1, "stream": True}, "chat.completions", 400),
        ({"messages": CHAT_MESSAGES, "model": "nope"}, "chat.completions", 404),
        ({"prompt": "", "max_tokens": 2}, "completions", 400),
        ({"prompt": "x", "max_tokens": 2}, "embeddings", 400),
    ],
    ids=["missing-messages", "empty-messages", "negative-max-tokens", "unknown-model", "empty-prompt",
         "unknown-endpoint"],
)  # fmt: skip
async def test_bad_request_gets_error_and_socket_keeps_working(
    server: ServerProcess, body: dict[str, Any], endpoint: str, status: int
) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            await s.request("good-1", chat_body(20, stream=True, return_token_ids=True))
            await s.request("bad", body, endpoint=endpoint)
            await s.until_final("bad")
            await s.request("good-2", chat_body(3, stream=True, return_token_ids=True))
            await s.until_final("good-1", "good-2")
            await s.settle()
    error = s.seen["bad"].final
    assert error["type"] == "error"
    assert error["status"] == status
    assert s.seen["bad"].chunks == []
    assert_openai_error({"error": error["error"]}, status)
    assert token_count(s.seen["good-1"]) == 20
    assert token_count(s.seen["good-2"]) == 3


async def test_malformed_message_gets_error_and_socket_keeps_working(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            bad = ("not json", json.dumps({"type": "launch", "id": "z"}), json.dumps({"type": "request"}))
            for raw in bad:
                await s.ws.send_message(raw)
                message = await s.next()
                assert message["type"] == "error"
                assert message["status"] == 400
                assert_openai_error({"error": message["error"]}, 400)
            await s.request("ok", chat_body(2, stream=True))
            await s.until_final("ok")
    assert s.seen["ok"].final["type"] == "done"


async def test_duplicate_id_while_running_is_refused(slow_server: ServerProcess) -> None:
    """The refusal is an error for that id while the first request's chunks keep coming."""
    with trio.fail_after(TIMEOUT):
        async with ws_session(slow_server, strict=False) as s:
            await s.request("dup", chat_body(30, stream=True, return_token_ids=True))
            while not s.seen.get("dup"):
                await s.next()
            await s.request("dup", chat_body(5, stream=True))
            while len(s.seen["dup"].finals) < 2:
                await s.next()
            await s.settle()
    types = sorted(m["type"] for m in s.seen["dup"].finals)
    assert types == ["done", "error"]
    assert token_count(s.seen["dup"]) == 30


async def test_duplicate_id_back_to_back_is_refused(slow_server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(slow_server, strict=False) as s:
            await s.request("dup", chat_body(10, stream=True, return_token_ids=True))
            await s.request("dup", chat_body(10, stream=True, return_token_ids=True))
            while len(s.seen.get("dup", Tracked()).finals) < 2:
                await s.next()
            await s.settle()
    assert sorted(m["type"] for m in s.seen["dup"].finals) == ["done", "error"]
    assert len(summarize(s.seen["dup"].chunks).ids) == 1


async def test_unencodable_request_gets_error_and_socket_survives(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(server) as s:
            await s.request("bad", chat_body(2, stream=True, stop_token_ids=[10**20]))
            await s.until_final("bad")
            await s.request("ok", chat_body(2, stream=True))
            await s.until_final("ok")
    assert s.seen["bad"].final["type"] == "error"
    assert s.seen["bad"].final["status"] == 400


async def test_client_closing_mid_stream_does_not_hurt_server(slow_server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with ws_session(slow_server) as s:
            await s.request("a", chat_body(2000, stream=True))
            await s.request("b", chat_body(2000, stream=True))
            while not (s.seen.get("a") and s.seen.get("b")):
                await s.next()
        async with ws_session(slow_server) as s:
            await s.request("c", chat_body(3, stream=True, return_token_ids=True))
            await s.until_final("c")
    assert token_count(s.seen["c"]) == 3


async def test_cancel_racing_completion_gets_one_final(slow_server: ServerProcess) -> None:
    server = slow_server
    steps = 60  # 0.6 s: r1 outlasts the handling of the big requests, so it ends behind their answers
    with trio.fail_after(TIMEOUT):
        # A tiny receive buffer and a client that does not read: the server's writer blocks soon.
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((server.host, server.port))
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(nursery, trio.SocketStream(sock), server.host, "/v1/ws")
            s = WsSession(ws)
            await s.request("r1", chat_body(steps))
            # ~700 KB of answers (each echoes 8000 prompt ids) that nobody reads yet.
            big = {"prompt": list(range(100000, 108000)), "max_tokens": 1, "return_token_ids": True}
            for i in range(12):
                await s.request(f"big{i}", big, endpoint="completions")
            # An HTTP request of the same length, started after r1, finishes no earlier than r1:
            # once it is back, r1 has finished too and its final message waits behind the backlog.
            async with await RawHttp.connect(server.host, server.port) as probe:
                await probe.send(post("/v1/chat/completions", chat_body(steps)))
                assert (await probe.read_response()).status == 200
            await s.cancel("r1")
            await s.until_final("r1", *(f"big{i}" for i in range(12)))
            await s.settle()
            await ws.aclose()
    assert [m["type"] for m in s.seen["r1"].finals] == ["response"]


async def test_upgrade_on_a_reused_connection(slow_server: ServerProcess) -> None:
    """An upgrade on a keep-alive connection that served another route first is served like a fresh
    one (the accept loop owns every connection), with the same protocol."""
    with trio.fail_after(TIMEOUT):
        raw = await RawHttp.connect(slow_server.host, slow_server.port)
        await raw.send(http_request("GET", "/v1/models"))
        assert (await raw.read_response()).status == 200
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(nursery, raw.stream, slow_server.host, "/v1/ws")
            s = WsSession(ws, strict=False)  # "a" is reused on purpose
            await s.request("a", chat_body(6, stream=True, return_token_ids=True))
            await s.request("b", chat_body(4, return_token_ids=True))
            await s.request("a", chat_body(2, stream=True))
            await s.ws.send_message("not json")
            while not (s.seen.get("b") and s.seen.get(None) and len(s.seen.get("a", Tracked()).finals) == 2):
                await s.next()
            await s.settle()
            await ws.aclose()
    assert sorted(m["type"] for m in s.seen["a"].finals) == ["done", "error"]
    assert token_count(s.seen["a"]) == 6
    assert s.seen["b"].final["type"] == "response"
    assert s.seen[None].final["status"] == 400


async def test_deeply_nested_messages_cost_only_themselves(slow_server: ServerProcess) -> None:
    """Nesting too deep to decode is an error without an id; deep but decodable nesting is an error for
    its id. Either way the socket and its running stream go on (it used to close with 1001)."""
    deep = "[" * 20_000 + "]" * 20_000
    body = '{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":%s}}'
    with trio.fail_after(TIMEOUT):
        async with ws_session(slow_server) as s:
            await s.request("long", chat_body(40, stream=True, return_token_ids=True))
            await s.ws.send_message('{"type":"request","id":"lost","body":%s}' % (body % deep))
            await s.ws.send_message('{"type":"request","id":"deep","body":%s}' % (body % deep[19_900:20_100]))
            await s.request("no-content", {"messages": [{"role": "user"}]})
            await s.until_final("long", "deep", "no-content")
            while None not in s.seen:
                await s.next()
            await s.settle()
    assert s.seen["long"].final["type"] == "done"
    assert token_count(s.seen["long"]) == 40
    assert s.seen[None].final["status"] == 400
    assert s.seen["deep"].final["error"]["param"] == "chat_template_kwargs"
    assert s.seen["no-content"].final["error"]["param"] == "messages[0].content"
    assert "lost" not in s.seen
