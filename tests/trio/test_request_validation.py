"""Request validation end to end, on the in-process stack (MockClock): unsupported parameters and
unknown fields are a 400 naming them over HTTP, neutral values stream normally, deep nesting is a
400 (never a 500), and over ``/v1/ws`` a bad message costs only itself, never the socket."""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import pytest
import trio
from trio.testing import MockClock
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from tests.trio.conftest import Stack
from tests.trio.test_streaming import chat_body
from tests.unit.test_request_schema import OUT_OF_RANGE, UNKNOWN, UNSUPPORTED_CASES

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
DEEP = 20_000


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


async def test_unsupported_refused_and_neutral_accepted_over_http(
    stack: Stack, autojump_clock: MockClock
) -> None:
    client = await stack.client()
    for param, kind, body, neutral in UNSUPPORTED_CASES:
        reply = await client.request(PATHS[kind], body)
        assert reply.status == 400, (param, reply.body)
        assert reply.json()["error"]["param"] == param
        for ok in neutral:
            reply = await client.request(PATHS[kind], ok)
            assert reply.status == 200, (param, ok, reply.body)
    assert not stack.api.serving.active


@pytest.mark.parametrize("cases", [OUT_OF_RANGE, UNKNOWN], ids=["out-of-range", "unknown-field"])
async def test_refused_over_http_with_the_param(
    stack: Stack, autojump_clock: MockClock, cases: list[tuple[str, str, dict[str, Any]]]
) -> None:
    client = await stack.client()
    for param, kind, body in cases:
        reply = await client.request(PATHS[kind], body)
        assert reply.status == 400, (param, reply.body)
        error = reply.json()["error"]
        assert error["param"] == param and error["type"] == "BadRequestError" and error["code"] == 400


async def test_user_message_without_content_is_a_400(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    reply = await client.request(PATHS["chat"], chat_body(5, messages=[{"role": "user"}]))
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "messages[0].content"
    tokenized = await client.request("/tokenize", {"messages": [{"role": "user"}]})
    assert tokenized.status == 400


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (PATHS["chat"], b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":%b}}'),
        (PATHS["chat"], b'{"messages":[{"role":"user","content":[{"type":"text","text":"x","z":%b}]}]}'),
        (PATHS["chat"], b'{"messages":[{"role":"user","content":"x"}],"tools":[%b]}'),
        (PATHS["completion"], b'{"prompt":"x","response_format":{"a":%b}}'),
        ("/tokenize", b'{"prompt":"x","extra":%b}'),
        ("/tokenize", b'{"messages":[{"role":"user","content":"x","tool_calls":[%b]}]}'),
        ("/detokenize", b'{"tokens":%b}'),
    ],
    ids=["template-kwargs", "content-part", "tools", "response-format", "tokenize", "tokenize-msg", "detok"],
)
@pytest.mark.parametrize("depth", [100, DEEP])
async def test_deep_nesting_is_a_400_and_the_connection_lives(
    stack: Stack, autojump_clock: MockClock, path: str, body: bytes, depth: int
) -> None:
    client = await stack.client()
    reply = await client.request(path, body % nested(depth))
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["code"] == 400
    again = await client.request(PATHS["completion"], {"prompt": "ok", "max_tokens": 1})
    assert again.status == 200


# ---- WebSocket ----------------------------------------------------------------------------------


class Ws:
    """A minimal /v1/ws client through the accept loop (the wiring a real client gets)."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._events: list[Any] = []
        self._text = ""

    async def _event(self) -> Any:
        while not self._events:
            data = await self.sock.recv(65536)
            assert data, "the server closed the connection"
            self.ws.receive_data(data)
            self._events += list(self.ws.events())
        return self._events.pop(0)

    async def send_raw(self, text: str) -> None:
        await self.sock.send(self.ws.send(TextMessage(data=text)))

    async def request(self, rid: str, body: dict[str, Any]) -> None:
        message = {"type": "request", "id": rid, "endpoint": "chat.completions", "body": body}
        await self.send_raw(msgspec.json.encode(message).decode())

    async def next(self) -> dict[str, Any]:
        while True:
            event = await self._event()
            assert isinstance(event, TextMessage), event
            self._text += event.data
            if event.message_finished:
                data: dict[str, Any] = msgspec.json.decode(self._text)
                self._text = ""
                return data


async def ws_client(stack: Stack) -> Ws:
    server_end, client_end = socket.socketpair()
    client = Ws(trio.socket.from_stdlib_socket(client_end))
    stack.nursery.start_soon(stack.api.http.handle_connection, server_end)
    await client.sock.send(client.ws.send(Request(host="test", target="/v1/ws")))
    assert isinstance(await client._event(), AcceptConnection)
    return client


async def test_bad_websocket_messages_cost_only_themselves(stack: Stack, autojump_clock: MockClock) -> None:
    c = await ws_client(stack)
    await c.request("long", chat_body(300))
    deep_body = '{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":%s}}'
    # Too deep to decode at all: an error without an id.
    await c.send_raw('{"type":"request","id":"lost","body":%s}' % (deep_body % nested(DEEP).decode()))
    # Deep but decodable, a message without content, an unknown field, a parameter out of range:
    # errors for their ids.
    await c.send_raw('{"type":"request","id":"deep","body":%s}' % (deep_body % nested(100).decode()))
    await c.request("empty", chat_body(5, messages=[{"role": "user"}]))
    await c.request("unknown", chat_body(5, foo=1))
    await c.request("penalty", chat_body(5, presence_penalty=5))
    await c.send_raw('{"type":"request","id":"notobject","body":[1]}')
    await c.request("after", chat_body(3))
    finals: dict[str | None, dict[str, Any]] = {}
    tokens = 0
    while "long" not in finals or "after" not in finals:
        msg = await c.next()
        if msg["type"] == "chunk":
            if msg["id"] == "long":
                tokens += sum(len(ch["token_ids"]) for ch in msg["data"]["choices"] if "token_ids" in ch)
            continue
        assert msg["id"] not in finals, msg
        finals[msg["id"]] = msg
    assert finals["long"]["type"] == "done" and tokens == 300
    assert finals["after"]["type"] == "done"
    assert finals[None]["status"] == 400 and "nested" in finals[None]["error"]["message"]
    assert finals["deep"]["error"]["param"] == "chat_template_kwargs"
    assert finals["empty"]["error"]["param"] == "messages[0].content"
    assert finals["unknown"]["error"]["param"] == "foo"
    assert finals["penalty"]["error"]["param"] == "presence_penalty"
    assert finals["notobject"]["status"] == 400
    assert all(
        finals[k]["type"] == "error" for k in (None, "deep", "empty", "unknown", "penalty", "notobject")
    )
    await trio.sleep(0.1)
    assert not stack.api.serving.active


async def test_a_bug_while_starting_a_ws_request_costs_only_that_request(
    stack: Stack, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = stack.api.serving
    start = serving.start

    async def buggy_start(kind: Any, body: bytes, sink: Any) -> Any:
        if b"boom" in body:
            raise RuntimeError("a bug")
        return await start(kind, body, sink)

    monkeypatch.setattr(serving, "start", buggy_start)
    c = await ws_client(stack)
    await c.request("long", chat_body(50))
    await c.request("boom", chat_body(5, user="boom"))
    finals: dict[str, dict[str, Any]] = {}
    while "long" not in finals or "boom" not in finals:
        msg = await c.next()
        if msg["type"] != "chunk":
            finals[msg["id"]] = msg
    assert finals["boom"]["type"] == "error" and finals["boom"]["status"] == 500
    assert finals["long"]["type"] == "done"


async def test_the_mock_engine_takes_constrained_requests_and_each_grammar_is_checked_once(
    stack: Stack, autojump_clock: MockClock
) -> None:
    """The mock engine ignores the grammar (docs/structured_output.md); the API server still checks
    it, once per distinct source, and refuses a bad one before anything reaches the engine."""
    client = await stack.client()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for _ in range(3):
        reply = await client.request(PATHS["chat"], chat_body(5, ignore_eos=False, response_format=schema))
        assert reply.status == 200, reply.body
        reply = await client.request(
            PATHS["completion"], {"prompt": "x", "max_tokens": 3, "guided_regex": "a+"}
        )
        assert reply.status == 200, reply.body
    assert stack.api.serving.grammars.compiles == 2
    reply = await client.request(PATHS["chat"], chat_body(5, ignore_eos=False, guided_regex="a(b"))
    assert reply.status == 400 and reply.json()["error"]["param"] == "guided_regex"
    assert not stack.api.serving.active


async def test_tokenize_renders_tools_as_a_chat_request_does(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    messages = [{"role": "user", "content": "weather?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    plain = await client.request("/tokenize", {"messages": messages})
    with_tools = await client.request("/tokenize", {"messages": messages, "tools": [tool]})
    assert plain.status == with_tools.status == 200
    ids = with_tools.json()["tokens"]
    assert with_tools.json()["count"] > plain.json()["count"]
    assert "get_weather" in stack.api.serving.tokenizer.decode(ids)  # the Qwen3 template's # Tools section
    bad = await client.request("/tokenize", {"messages": messages, "tools": [{"type": "code"}]})
    assert bad.status == 400 and bad.json()["error"]["param"] == "tools[0]"
