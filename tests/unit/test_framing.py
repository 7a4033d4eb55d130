"""The sans-I/O framing of streamed output: SSE events (``protocol/sse.py``) and the WebSocket side of
``/v1/ws`` (``protocol/ws_frames.py``), checked against independent readers (h11, wsproto)."""

from __future__ import annotations

import socket

import h11
import msgspec
import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

from trioserve.frontend.edge.http_sink import HttpSink
from trioserve.frontend.request.errors import ApiError
from trioserve.protocol import sse
from trioserve.protocol.ws_frames import (
    CHUNK,
    GOING_AWAY,
    NO_ID,
    accept_key,
    chunk_message,
    close_frame,
    done_message,
    error_message,
    response_message,
    text_frame,
    upgrade_response,
)

PAYLOADS = [b"{}", b'{"choices":[{"index":0,"text":"hi"}]}', b'{"text":"' + b"x" * 70_000 + b'"}']


def _after_request(http_version: str = "1.1") -> tuple[h11.Connection, h11.Connection]:
    """A server and a client h11 connection once the server has read a request."""
    server, client = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    request = client.send(h11.Request(method="POST", target="/", headers=[("host", "t")]))
    assert request is not None
    request += client.send(h11.EndOfMessage()) or b""
    server.receive_data(request.replace(b"HTTP/1.1", b"HTTP/" + http_version.encode(), 1))
    while server.next_event() is not h11.NEED_DATA:
        pass
    return server, client


def _streaming_pair(http_version: str = "1.1") -> tuple[h11.Connection, h11.Connection, bytes]:
    """The same, and the event stream's head."""
    server, client = _after_request(http_version)
    head = server.send(h11.Response(status_code=200, headers=sse.HEADERS)) or b""
    return server, client, head


def _read_events(body: bytes) -> list[bytes]:
    """An SSE reader: the ``data`` of each event, in order."""
    assert body.endswith(b"\n\n")
    events = []
    for block in body[:-2].split(b"\n\n"):
        assert block.startswith(b"data: ") and b"\n" not in block, block[:80]
        events.append(block.removeprefix(b"data: "))
    return events


def test_an_sse_event_is_the_chunk_h11_would_write() -> None:
    server, _, _ = _streaming_pair()
    for payload in PAYLOADS:
        assert sse.event_chunk(payload) == server.send(h11.Data(data=sse.EVENT % payload))
    assert sse.done(chunked=True) == server.send(h11.Data(data=sse.DONE))
    assert sse.events(PAYLOADS, chunked=True) == b"".join(map(sse.event_chunk, PAYLOADS))


@pytest.mark.parametrize("http_version", ["1.1", "1.0"])
def test_a_client_reads_the_events_and_done_back(http_version: str) -> None:
    server, client, head = _streaming_pair(http_version)
    chunked = server.their_http_version != b"1.0"  # what the sink decides, the same way
    assert chunked == (http_version == "1.1")
    wire = head + sse.events(PAYLOADS[:2], chunked) + sse.events(PAYLOADS[2:], chunked) + sse.done(chunked)
    wire += server.send(h11.EndOfMessage()) or b""
    client.receive_data(wire)
    if not chunked:
        client.receive_data(b"")  # a close-delimited body ends when the server closes
    body, chunks = b"", 0
    while True:
        event = client.next_event()
        if isinstance(event, h11.Data):
            body += event.data
            chunks += event.chunk_end  # one event, one chunk: each ends where its event ends
        elif isinstance(event, h11.EndOfMessage):
            break
    assert _read_events(body) == [*PAYLOADS, b"[DONE]"]
    assert chunks == (len(PAYLOADS) + 1 if chunked else 0)


def test_the_sinks_per_token_path_writes_the_same_bytes() -> None:
    """``HttpSink.event`` formats the chunk inline (no call per token): the bytes must not drift."""
    server, _ = _after_request()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        sink = HttpSink(ours, server)
        sink.events([PAYLOADS[0]])  # the head goes out with the first event
        theirs.recv(65536)
        sink.event(PAYLOADS[1])
        assert theirs.recv(65536) == sse.event_chunk(PAYLOADS[1])


def _accepted_client() -> WSConnection:
    client = WSConnection(ConnectionType.CLIENT)
    accepted = upgrade_response(client.send(Request(host="t", target="/v1/ws")), b"/v1/ws")
    assert accepted is not None
    client.receive_data(accepted[0])
    assert isinstance(next(client.events()), AcceptConnection)
    return client


def test_text_frames_of_every_length_encoding() -> None:
    client = _accepted_client()
    for n in (0, 1, 125, 126, 65535, 65536, 200_000):
        message = b"x" * n
        client.receive_data(text_frame(message))
        events = list(client.events())
        assert len(events) == 1 and isinstance(events[0], TextMessage), events
        assert events[0].data == message.decode() and events[0].message_finished


def test_close_frames() -> None:
    client = _accepted_client()
    client.receive_data(GOING_AWAY)
    (event,) = client.events()
    assert isinstance(event, CloseConnection)
    assert (event.code, event.reason) == (1001, "the server is shutting down")
    with pytest.raises(ValueError, match="125 bytes"):
        close_frame(1000, b"x" * 124)


def test_only_websocket_upgrades_of_the_route_are_accepted() -> None:
    def head(path: str, *extra: str) -> bytes:
        lines = [f"GET {path} HTTP/1.1", "Host: t", *extra, "", ""]
        return "\r\n".join(lines).encode()

    upgrade = ("Upgrade: websocket", "Connection: keep-alive, Upgrade", "Sec-WebSocket-Version: 13",
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")  # fmt: skip
    accepted = upgrade_response(head("/v1/ws?x=1", *upgrade) + b"\x81\x80", b"/v1/ws")
    assert accepted is not None
    response, leftover = accepted
    assert response.startswith(b"HTTP/1.1 101 ")
    assert b"sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in response  # RFC 6455's example
    assert accept_key(b"dGhlIHNhbXBsZSBub25jZQ==") == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    assert leftover == b"\x81\x80"  # frames sent early are kept
    assert upgrade_response(head("/v1/ws"), b"/v1/ws") is None  # plain GET: the accept loop answers 426
    assert upgrade_response(head("/v1/wsx", *upgrade), b"/v1/ws") is None
    assert upgrade_response(head("/v1/models", *upgrade), b"/v1/ws") is None
    assert upgrade_response(head("/v1/ws", *upgrade[:2], upgrade[3]), b"/v1/ws") is None  # no version
    assert upgrade_response(b"GET /v1/ws HTTP/1.1\r\nHost", b"/v1/ws") is None  # an incomplete head
    assert upgrade_response(b"\x16\x03\x01garbage\r\n\r\n", b"/v1/ws") is None


def test_messages_are_the_documented_json() -> None:
    tag = 'r"1'  # an id that needs escaping
    rid = msgspec.json.encode(tag)
    chunk = b'{"choices":[]}'
    assert chunk_message(rid, chunk) == CHUNK % (rid, chunk)
    decode = msgspec.json.decode
    assert decode(chunk_message(rid, chunk)) == {"type": "chunk", "id": tag, "data": {"choices": []}}
    assert decode(done_message(rid)) == {"type": "done", "id": tag}
    assert decode(response_message(rid, b'{"id":"x"}')) == {
        "type": "response",
        "id": tag,
        "data": {"id": "x"},
    }
    body = ApiError(400, "bad", param="n").body()
    error = decode(body)["error"]
    assert decode(error_message(rid, 400, body)) == {
        "type": "error",
        "id": tag,
        "status": 400,
        "error": error,
    }
    # An error for a message that names no request: the bytes a dict encoding gives, key order included.
    expected = msgspec.json.encode({"type": "error", "id": None, "status": 400, "error": error})
    assert error_message(NO_ID, 400, body) == expected
