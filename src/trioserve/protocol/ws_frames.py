"""The WebSocket side of ``/v1/ws`` as the server writes it: bytes in, bytes out (sans-I/O).

Three layers, all pure (docs/websocket.md):

- the opening handshake (RFC 6455 section 4.2): ``upgrade_response`` reads a client's upgrade request
  (with h11) and answers it with ``101 Switching Protocols``;
- frames: the server's text and close frames, encoded by hand, because that is cheaper per token than
  a protocol object's ``send``. Rule: a server frame is final and never masked (RFC 6455 section
  5.1), so its header is the opcode byte and the payload length in 1, 3 or 9 bytes. Reading the
  client's frames (masks, fragments, control frames) is wsproto's, not this module's;
- messages: the JSON envelopes of a request's output (``chunk``, ``done``, ``response``, ``error``).
  ``id`` is the request's id already encoded as JSON; ``CHUNK`` is formatted inline on the per-token
  path (the same bytes as ``chunk_message``, without a call per token).
"""

from __future__ import annotations

import base64
import hashlib

import h11
import msgspec

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
_MAX_HEAD = 64 * 1024


# ---- frames ---------------------------------------------------------------------------------------------


def text_frame(message: bytes) -> bytes:
    """One final, unmasked text frame (servers never mask)."""
    n = len(message)
    if n < 126:
        return b"\x81%c%b" % (n, message)
    if n < 65536:
        return b"\x81\x7e%c%c%b" % (n >> 8, n & 0xFF, message)
    return b"\x81\x7f%b%b" % (n.to_bytes(8, "big"), message)


def close_frame(code: int, reason: bytes) -> bytes:
    """A close frame: the status code, then the UTF-8 reason (125 bytes at most, RFC 6455 5.5)."""
    payload = code.to_bytes(2, "big") + reason
    if len(payload) > 125:
        raise ValueError("a close frame's code and reason must fit in 125 bytes")
    return b"\x88%c%b" % (len(payload), payload)


GOING_AWAY = close_frame(1001, b"the server is shutting down")


# ---- the opening handshake ------------------------------------------------------------------------------


def accept_key(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` answer to ``Sec-WebSocket-Key: key``."""
    return base64.b64encode(hashlib.sha1(key + _GUID).digest())


def upgrade_response(prefix: bytes, path: bytes) -> tuple[bytes, bytes] | None:
    """If ``prefix`` (the bytes read so far) is a WebSocket upgrade of ``path`` (its query aside): the
    ``101`` response and the bytes after the request. None for anything else (a plain request, another
    path, a version other than 13): the caller answers it as HTTP."""
    get = b"GET " + path
    if not (prefix.startswith(get) and prefix[len(get) : len(get) + 1] in (b" ", b"?")):
        return None
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
    conn.receive_data(prefix)
    try:
        request = conn.next_event()
        end = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(request, h11.Request) or not isinstance(end, h11.EndOfMessage):
        return None
    headers = dict(request.headers)  # h11 lower-cases names
    tokens = [t.strip().lower() for t in headers.get(b"connection", b"").split(b",")]
    key = headers.get(b"sec-websocket-key")
    if (
        b"upgrade" not in tokens
        or headers.get(b"upgrade", b"").lower() != b"websocket"
        or headers.get(b"sec-websocket-version") != b"13"
        or not key
    ):
        return None
    head = conn.send(
        h11.InformationalResponse(
            status_code=101,
            reason=b"Switching Protocols",
            headers=[
                (b"upgrade", b"websocket"),
                (b"connection", b"Upgrade"),
                (b"sec-websocket-accept", accept_key(key)),
            ],
        )
    )
    return head or b"", conn.trailing_data[0]


# ---- messages -------------------------------------------------------------------------------------------

CHUNK = b'{"type":"chunk","id":%b,"data":%b}'  # a streamed chunk: id, the SSE event's payload
_DONE = b'{"type":"done","id":%b}'
_RESPONSE = b'{"type":"response","id":%b,"data":%b}'
_ERROR = b'{"type":"error","id":%b,"status":%d,"error":%b}'
NO_ID = b"null"  # the id of an error for a message that names no request


def chunk_message(id_json: bytes, payload: bytes) -> bytes:
    return CHUNK % (id_json, payload)


def done_message(id_json: bytes) -> bytes:
    """The end of a streamed request (the ``data: [DONE]`` of SSE)."""
    return _DONE % id_json


def response_message(id_json: bytes, body: bytes) -> bytes:
    """A whole (non-streamed) response: the HTTP route's JSON body."""
    return _RESPONSE % (id_json, body)


def error_message(id_json: bytes, status: int, body: bytes) -> bytes:
    """A refused request: ``body`` is the HTTP route's error body (``{"error": {...}}``); the message
    carries its error object."""
    error = msgspec.json.decode(body)["error"]
    return _ERROR % (id_json, status, msgspec.json.encode(error))
