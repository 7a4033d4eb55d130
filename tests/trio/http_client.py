"""A small HTTP/1.1 test client over a trio socket, parsing with h11 (client side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import h11
import msgspec
import trio


@dataclass
class SseEvent:
    time: float  # trio.current_time() when the event was read
    data: Any  # decoded JSON, or the string "[DONE]"


@dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes = b""
    events: list[SseEvent] = field(default_factory=list)

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.data != "[DONE]"]

    def content_events(self) -> list[dict[str, Any]]:
        """Chunks that carry tokens (not the role chunk, not the usage chunk)."""
        return [c for c in self.chunks if c.get("choices") and c["choices"][0].get("token_ids") is not None]


class HttpClient:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT)
        self._sse_buf = b""

    async def send_request(self, path: str, body: Any, method: str = "POST") -> None:
        payload = body if isinstance(body, bytes) else msgspec.json.encode(body)
        headers = [
            ("host", "test"),
            ("content-type", "application/json"),
            ("content-length", str(len(payload))),
        ]
        data = self.conn.send(h11.Request(method=method, target=path, headers=headers)) or b""
        data += (self.conn.send(h11.Data(data=payload)) or b"") + (self.conn.send(h11.EndOfMessage()) or b"")
        await self.sock.send(data)

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.sock.recv(65536))
                continue
            return event

    async def read_head(self) -> Reply:
        event = await self.next_event()
        assert isinstance(event, h11.Response), event
        return Reply(event.status_code, dict(event.headers))

    async def read_body(self, reply: Reply, max_events: int | None = None) -> Reply:
        """Read body data until the end of the message (or ``max_events`` SSE events)."""
        sse = reply.headers.get(b"content-type", b"").startswith(b"text/event-stream")
        while max_events is None or len(reply.events) < max_events:
            event = await self.next_event()
            if isinstance(event, h11.EndOfMessage):
                break
            assert isinstance(event, h11.Data), event
            if not sse:
                reply.body += event.data
                continue
            self._sse_buf += event.data
            while b"\n\n" in self._sse_buf:
                block, self._sse_buf = self._sse_buf.split(b"\n\n", 1)
                assert block.startswith(b"data: "), block
                text = block[6:]
                data = "[DONE]" if text == b"[DONE]" else msgspec.json.decode(text)
                reply.events.append(SseEvent(trio.current_time(), data))
        return reply

    async def request(self, path: str, body: Any, method: str = "POST") -> Reply:
        await self.send_request(path, body, method)
        reply = await self.read_body(await self.read_head())
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return reply

    def close(self) -> None:
        self.sock.close()
