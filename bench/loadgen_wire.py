"""The load generator's wire readers: bytes in, counts out, no sockets (``bench/sse_loadgen.py``).

``ResponseParser`` reads one HTTP/1.1 response (status line, headers, then a chunked, Content-Length or
close-delimited body) carrying an SSE stream; ``WsResponseParser`` reads one request's messages on an open
``/v1/ws`` socket. Both decode each event with one ``msgspec`` call into structs that keep only
``choices[].token_ids`` and the text, and update the shared ``Counters`` (tokens, events, the
tokens-per-event histogram) and the request's TTFT and ITL. ``ws_frame`` and ``ws_accept_key`` are the
client side of RFC 6455 framing and handshake; ``parse_retry_after`` and ``backoff_seconds`` turn a
429/503's ``Retry-After`` into the client's wait. Nothing here touches a socket, so every piece is checked
by feeding it bytes (``bench/test_sse_loadgen.py``). It imports nothing else of the load generator.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import math
import time

import msgspec


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None  # chat
    text: str | None = None  # completions
    token_ids: list[int] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    error: object = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class _WsMessage(msgspec.Struct):
    """A server message on ``/v1/ws`` (docs/websocket.md); ``data`` of a chunk is an SSE payload."""

    type: str
    id: str | None = None
    data: _Chunk | None = None
    status: int = 0
    error: object = None


_decode_ws = msgspec.json.Decoder(_WsMessage).decode

HIST_MAX = 64  # tokens-per-event histogram buckets; the last one means ">= HIST_MAX"
REJECT_STATUSES = (429, 503)  # admission refusals: counted as rejected, the client backs off
DEFAULT_RETRY_AFTER_S = 1.0  # backoff after a refusal without a usable Retry-After header
MAX_BACKOFF_S = 5.0


def parse_retry_after(value: bytes | str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header value (delay-seconds or an HTTP-date); None if
    absent or unparsable. ``now`` (Unix time) is for the HTTP-date form; default: the current time."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not text:
        return None
    try:
        secs = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        secs = when.timestamp() - (time.time() if now is None else now)
    if math.isnan(secs):
        return None
    return max(0.0, secs)


def backoff_seconds(retry_after: float | None, cap: float = MAX_BACKOFF_S) -> float:
    """How long a refused client waits: ``Retry-After`` if given, else 1 s; never more than ``cap``."""
    return min(cap, DEFAULT_RETRY_AFTER_S if retry_after is None else retry_after)


class Counters:
    """Running totals shared by all clients (one trio thread, so plain ints are consistent)."""

    __slots__ = ("bad_events", "hist", "no_token_ids", "sse_events", "token_events", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.token_events = 0  # SSE events that carried at least one token
        self.sse_events = 0  # all data events except [DONE]
        self.no_token_ids = 0  # token events without token_ids (counted as one token each)
        self.bad_events = 0  # undecodable data events
        self.hist = [0] * (HIST_MAX + 1)

    def snapshot(self) -> Counters:
        c = Counters()
        c.tokens, c.token_events, c.sse_events = self.tokens, self.token_events, self.sse_events
        c.no_token_ids, c.bad_events, c.hist = self.no_token_ids, self.bad_events, list(self.hist)
        return c


_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _LENGTH, _EOF, _COMPLETE = range(8)


class ResponseParser:
    """Incremental reader of one HTTP/1.1 response carrying an SSE stream.

    ``feed`` takes bytes as they arrive; ``complete`` turns true at the end of the body (the terminal
    chunk of a chunked body, Content-Length reached); ``eof`` handles a close. ``error`` names the first
    failure seen (non-200 status, stream error event, malformed framing, truncated stream).
    """

    __slots__ = (
        "_buf",
        "_crlf",
        "_left",
        "_sse",
        "_state",
        "complete",
        "counters",
        "done_seen",
        "error",
        "error_body",
        "events",
        "first_token_at",
        "itl",
        "keep_alive",
        "last_token_at",
        "pong",
        "retry_after",
        "status",
        "tokens",
    )

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._buf = bytearray()
        self._sse = bytearray()
        self._state = _HEAD
        self._left = 0
        self._crlf = False
        self.status = 0
        self.retry_after: float | None = None  # seconds, from a Retry-After header
        self.keep_alive = True
        self.complete = False
        self.done_seen = False
        self.error: str | None = None
        self.error_body = bytearray()
        self.tokens = 0
        self.events = 0  # events that carried at least one token
        self.itl: list[float] = []  # seconds between consecutive token-carrying events
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.pong = b""  # WebSocket only: frames the connection owes the server (pongs)

    # -- framing ------------------------------------------------------------------------------------

    def feed(self, data: bytes, now: float) -> None:
        if self._state == _CHUNK_SIZE and not self._buf and not self._sse:
            # Fast path for the common case: whole chunks, each one complete `data: {...}` event.
            data = self._whole_chunks(data, now)
            if not data:
                return
        if self._state == _HEAD:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    self._fail("header too large")
                return
            self._head(bytes(self._buf[:end]))
            data = bytes(self._buf[end + 4 :])
            self._buf.clear()
            if self._state == _COMPLETE or not data:
                return
        state = self._state
        if state == _LENGTH:
            take = data[: self._left]
            self._left -= len(take)
            self._body(take, now)
            if self._left == 0:
                self._finish()
        elif state == _EOF:
            self._body(data, now)
        elif state != _COMPLETE:
            self._chunked(data, now)

    def eof(self, now: float) -> None:
        """The peer closed the connection."""
        if self._state == _EOF:
            self._finish()
        elif not self.complete:
            self._fail("truncated stream")
        self.keep_alive = False

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        try:
            self.status = int(parts[1])
        except (IndexError, ValueError):
            self._fail("bad status line")
            return
        http10 = parts[0] == b"HTTP/1.0"
        chunked = False
        length = -1
        conn = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value.strip())
            elif name == b"connection":
                conn = value.strip().lower()
            elif name == b"retry-after":
                self.retry_after = parse_retry_after(value)
        self.keep_alive = (conn == b"keep-alive") if http10 else (conn != b"close")
        if self.status != 200:
            self.error = f"http {self.status}"
        if chunked:
            self._state = _CHUNK_SIZE
        elif length >= 0:
            self._left = length
            self._state = _LENGTH
            if length == 0:
                self._finish()
        else:
            self._state = _EOF
            self.keep_alive = False

    def _chunked(self, data: bytes, now: float) -> None:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        state = self._state
        while pos < end:
            if state == _CHUNK_DATA:
                take = min(self._left, end - pos)
                self._body(buf[pos : pos + take], now)
                pos += take
                self._left -= take
                if self._left:
                    break
                state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    self._fail("bad chunk framing")
                    return
                pos += 2
                state = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                try:
                    size = int(buf[pos:nl].split(b";", 1)[0], 16)
                except ValueError:
                    self._fail("bad chunk size")
                    return
                pos = nl + 2
                if size == 0:
                    state = _TRAILER
                else:
                    self._left = size
                    state = _CHUNK_DATA
            else:  # _TRAILER: lines up to an empty one
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                empty = nl == pos
                pos = nl + 2
                if empty:
                    self._state = state
                    del buf[:pos]
                    self._finish()
                    return
        self._state = state
        del buf[:pos]

    def _whole_chunks(self, data: bytes, now: float) -> bytes:
        """Consume leading chunks that are each exactly one JSON data event; return the rest."""
        pos = 0
        n = len(data)
        while pos < n:
            nl = data.find(b"\r\n", pos)
            if nl < 0:
                break
            try:
                size = int(data[pos:nl], 16)
            except ValueError:
                break
            start = nl + 2
            end = start + size
            # One `data: ...` line (JSON, so it does not start with "[DONE]"), then "\n\n", then CRLF.
            if (
                not size
                or end + 2 > n
                or not data.startswith(b"data: {", start)
                or not data.startswith(b"\n\n\r\n", end - 2)
                or data.find(b"\n", start, end) != end - 2
            ):
                break
            self._json(data[start + 6 : end - 2], now)
            pos = end + 2
        return data[pos:] if pos else data

    @property
    def rejected(self) -> bool:
        """The server refused the request (429/503 status line): admission control, not a failure."""
        return self.status in REJECT_STATUSES

    def _finish(self) -> None:
        self._state = _COMPLETE
        self.complete = True
        if self.error is None and not self.done_seen:
            self.error = "no [DONE]"

    def _fail(self, why: str) -> None:
        if self.error is None or self.error.startswith("http"):
            self.error = why
        self.keep_alive = False
        self._state = _COMPLETE
        self.complete = True

    # -- SSE ----------------------------------------------------------------------------------------

    def _body(self, payload: bytes | bytearray, now: float) -> None:
        if self.status != 200:
            if len(self.error_body) < 400:
                self.error_body += payload[: 400 - len(self.error_body)]
            return
        sse = self._sse
        if not sse and not self._crlf and b"\r" in payload:
            self._crlf = True
        if self._crlf:
            payload = bytes(payload).replace(b"\r\n", b"\n")
        sse += payload
        pos = 0
        while True:
            idx = sse.find(b"\n\n", pos)
            if idx < 0:
                break
            self._event(bytes(sse[pos:idx]), now)
            pos = idx + 2
        if pos:
            del sse[:pos]

    def _event(self, ev: bytes, now: float) -> None:
        if ev.startswith(b"data: ") and b"\n" not in ev:
            payload = ev[6:]
        else:
            datas = [ln[5:] for ln in ev.split(b"\n") if ln.startswith(b"data:")]
            if not datas:
                return  # comment / keep-alive / event-name only
            payload = b"\n".join(d[1:] if d.startswith(b" ") else d for d in datas)
        if payload == b"[DONE]":
            self.done_seen = True
            return
        self._json(payload, now)

    def _json(self, payload: bytes, now: float) -> None:
        counters = self.counters
        counters.sse_events += 1
        try:
            chunk = _decode_chunk(payload)
        except msgspec.DecodeError:
            counters.bad_events += 1
            return
        if chunk.error is not None and self.error is None:
            self.error = "stream error event"
            if not self.error_body:
                self.error_body += payload[:400]
        self._count(chunk, now)

    def _count(self, chunk: _Chunk, now: float) -> None:
        counters = self.counters
        n = 0
        for choice in chunk.choices:
            ids = choice.token_ids
            if ids is not None:
                n += len(ids)
            elif (choice.delta is not None and choice.delta.content) or choice.text:
                n += 1
                counters.no_token_ids += 1
        if n:
            counters.tokens += n
            counters.token_events += 1
            counters.hist[n if n < HIST_MAX else HIST_MAX] += 1
            if self.tokens:
                self.itl.append(now - self.last_token_at)
            else:
                self.first_token_at = now
            self.last_token_at = now
            self.tokens += n
            self.events += 1


_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """One final client frame. Clients must mask; the all-zero key leaves the payload as it is, so no
    per-byte XOR is needed (RFC 6455 lets servers reject nothing on the key's value)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 65536:
        head = bytes((0x80 | opcode, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def ws_accept_key(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` value a server must answer ``Sec-WebSocket-Key: key`` with."""
    return base64.b64encode(hashlib.sha1(key + _WS_GUID).digest())


class WsResponseParser(ResponseParser):
    """One request's messages on an open ``/v1/ws`` socket: server frames (unmasked, possibly
    fragmented), each text message one JSON object (``chunk``, ``done``, ``response``, ``error``).
    The same counters, TTFT, ITL and error fields as the SSE reader."""

    __slots__ = ("_frag",)

    def __init__(self, counters: Counters) -> None:
        super().__init__(counters)
        self._frag: bytearray | None = None
        self.status = 200  # the socket is open; an ``error`` message sets the request's status

    def feed(self, data: bytes, now: float) -> None:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        while end - pos >= 2 and not self.complete:
            b0 = buf[pos]
            b1 = buf[pos + 1]
            size = b1 & 0x7F
            head = 2
            if size == 126:
                if end - pos < 4:
                    break
                size = int.from_bytes(buf[pos + 2 : pos + 4], "big")
                head = 4
            elif size == 127:
                if end - pos < 10:
                    break
                size = int.from_bytes(buf[pos + 2 : pos + 10], "big")
                head = 10
            mask = b""
            if b1 & 0x80:  # servers must not mask; tolerate it anyway
                if end - pos < head + 4:
                    break
                mask = bytes(buf[pos + head : pos + head + 4])
                head += 4
            if end - pos < head + size:
                break
            payload = bytes(buf[pos + head : pos + head + size])
            pos += head + size
            if mask:
                key = int.from_bytes((mask * (size // 4 + 1))[:size], "big")
                payload = (int.from_bytes(payload, "big") ^ key).to_bytes(size, "big")
            opcode = b0 & 0x0F
            fin = b0 & 0x80
            if opcode in (0x1, 0x2):
                if fin:
                    self._message(payload, now)
                else:
                    self._frag = bytearray(payload)
            elif opcode == 0x0:
                if self._frag is None:
                    self._fail("bad websocket framing")
                    break
                self._frag += payload
                if fin:
                    whole = bytes(self._frag)
                    self._frag = None
                    self._message(whole, now)
            elif opcode == 0x8:
                self._fail("websocket closed")
            elif opcode == 0x9:
                self.pong += ws_frame(0xA, payload)
            # 0xA (pong) and unknown opcodes: ignored
        del buf[:pos]

    def eof(self, now: float) -> None:
        if not self.complete:
            self._fail("truncated stream")
        self.keep_alive = False

    def _message(self, payload: bytes, now: float) -> None:
        counters = self.counters
        try:
            msg = _decode_ws(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            counters.sse_events += 1
            counters.bad_events += 1
            return
        kind = msg.type
        if kind == "chunk":
            counters.sse_events += 1
            chunk = msg.data
            if chunk is None:
                counters.bad_events += 1
                return
            if chunk.error is not None and self.error is None:
                self.error = "stream error event"
                if not self.error_body:
                    self.error_body += payload[:400]
            self._count(chunk, now)
        elif kind in ("done", "response"):
            self.done_seen = True
            self._state = _COMPLETE
            self.complete = True
        elif kind == "error":
            self.status = msg.status or 500
            if self.error is None:
                self.error = f"http {self.status}"
            self.error_body += msgspec.json.encode(msg.error)[:400]
            self._state = _COMPLETE
            self.complete = True
