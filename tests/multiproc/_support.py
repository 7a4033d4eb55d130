"""Helpers shared by the multi-process tests: a raw HTTP/1.1 client over a trio socket, SSE parsing,
OpenAI error-shape checks, a WebSocket session wrapper, and /proc inspection.

The HTTP client is deliberately hand-written (no h11, no httpx): the point of these tests is to see
the bytes a plain client like ``curl -N`` sees, framing included.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import trio

CHAT_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Count to three, please."},
]


@asynccontextmanager
async def sdk_client(
    url: str, timeout: float = 60.0, api_key: str = "x"
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The unmodified ``openai`` SDK against ``url``. No retries: a retried 5xx would hide a bug."""
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
    try:
        yield sdk
    finally:
        await sdk.close()


# --------------------------------------------------------------------------------------------------
# Raw HTTP/1.1
# --------------------------------------------------------------------------------------------------


@dataclass
class RawResponse:
    version: str
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    framing: str = "none"  # "chunked", "length", "close" or "none" (1xx / head only)
    chunks: list[bytes] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        return json.loads(self.body)


class RawHttp:
    """One TCP connection; requests are bytes we write, responses are parsed by hand."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self.eof = False

    @classmethod
    async def connect(cls, host: str, port: int) -> RawHttp:
        return cls(await trio.open_tcp_stream(host, port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> RawHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _fill(self) -> bool:
        if self.eof:
            return False
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            return False
        self._buf += data
        return True

    async def read_until(self, delim: bytes) -> bytes:
        while True:
            at = self._buf.find(delim)
            if at >= 0:
                out = bytes(self._buf[: at + len(delim)])
                del self._buf[: at + len(delim)]
                return out
            if not await self._fill():
                raise EOFError(f"connection closed before {delim!r}; buffered {bytes(self._buf)!r}")

    async def read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not await self._fill():
                raise EOFError(f"connection closed after {len(self._buf)} of {n} bytes")
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def read_to_eof(self) -> bytes:
        while await self._fill():
            pass
        out = bytes(self._buf)
        self._buf.clear()
        return out

    async def at_eof(self) -> bool:
        """True once the peer has closed and everything it sent was consumed."""
        if self._buf:
            return False
        return not await self._fill()

    async def read_head(self) -> RawResponse:
        head = (await self.read_until(b"\r\n\r\n")).decode("latin-1")
        lines = head[:-4].split("\r\n")
        version, status, *reason = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.append((name.strip().lower(), value.strip()))
        response = RawResponse(version, int(status), reason[0] if reason else "", headers)
        if "chunked" in (response.header("transfer-encoding") or "").lower():
            response.framing = "chunked"
        elif response.header("content-length") is not None:
            response.framing = "length"
        elif 100 <= response.status < 200 or response.status in (204, 304):
            response.framing = "none"
        else:
            response.framing = "close"
        return response

    async def read_chunk(self) -> bytes:
        """One chunk of a chunked body; b"" for the last chunk (trailers consumed)."""
        size_line = await self.read_until(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await self.read_until(b"\r\n") != b"\r\n":  # optional trailers
                pass
            return b""
        data = await self.read_exact(size)
        if await self.read_exact(2) != b"\r\n":
            raise AssertionError("chunk data is not followed by CRLF")
        return data

    async def read_body(self, response: RawResponse) -> RawResponse:
        if response.framing == "chunked":
            while chunk := await self.read_chunk():
                response.chunks.append(chunk)
            response.body = b"".join(response.chunks)
        elif response.framing == "length":
            response.body = await self.read_exact(int(response.header("content-length") or 0))
        elif response.framing == "close":
            response.body = await self.read_to_eof()
        return response

    async def read_response(self) -> RawResponse:
        """The next final response (1xx responses are skipped) with its whole body."""
        while True:
            response = await self.read_head()
            if not 100 <= response.status < 200:
                return await self.read_body(response)


def http_request(
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    version: str = "HTTP/1.1",
    headers: list[tuple[str, str]] | None = None,
    content_length: int | None = None,
) -> bytes:
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1"]
    for name, value in headers or []:
        lines.append(f"{name}: {value}")
    if body is not None or content_length is not None:
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body or b'') if content_length is None else content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def post(path: str, obj: Any, **kw: Any) -> bytes:
    return http_request("POST", path, json.dumps(obj).encode(), **kw)


async def request_json(host: str, port: int, method: str, path: str, obj: Any = None) -> tuple[int, Any]:
    """One request on a fresh connection; returns (status, decoded JSON body or None)."""
    body = None if obj is None else json.dumps(obj).encode()
    async with await RawHttp.connect(host, port) as conn:
        await conn.send(http_request(method, path, body, headers=[("Connection", "close")]))
        response = await conn.read_response()
    return response.status, (response.json() if response.body else None)


# --------------------------------------------------------------------------------------------------
# SSE and OpenAI shapes
# --------------------------------------------------------------------------------------------------


def parse_sse(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order; checks event framing strictly."""
    text = body.decode("utf-8")
    assert text.endswith("\n\n"), f"SSE body does not end with a blank line: {text[-80:]!r}"
    payloads = []
    for event in text[:-2].split("\n\n"):
        data_lines = [line[len("data:") :].removeprefix(" ") for line in event.split("\n") if line]
        assert all(line.startswith("data:") for line in event.split("\n") if line), event
        payloads.append("\n".join(data_lines))
    return payloads


def sse_chunks(body: bytes) -> list[dict[str, Any]]:
    """Decoded chunks of a finished stream; asserts it ends with exactly one ``[DONE]``."""
    payloads = parse_sse(body)
    assert payloads, "empty stream"
    assert payloads[-1] == "[DONE]", f"stream does not end with [DONE]: {payloads[-1]!r}"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


@dataclass
class StreamSummary:
    """What a client reconstructs from a streamed response's chunks."""

    ids: set[str]
    texts: dict[int, str]
    token_ids: dict[int, list[int]]
    finish: dict[int, str | None]
    roles: dict[int, str]
    usage: dict[str, int] | None
    objects: set[str]


def summarize(chunks: list[dict[str, Any]]) -> StreamSummary:
    s = StreamSummary(set(), {}, {}, {}, {}, None, set())
    for chunk in chunks:
        s.ids.add(chunk["id"])
        s.objects.add(chunk["object"])
        if chunk.get("usage"):
            assert chunk["choices"] == [], "the usage chunk carries no choices"
            assert s.usage is None, "two usage chunks"
            s.usage = chunk["usage"]
            continue
        assert s.usage is None, "a chunk after the usage chunk"
        for choice in chunk["choices"]:
            i = choice["index"]
            assert s.finish.get(i) is None, f"choice {i} got a chunk after its finish_reason"
            if "delta" in choice:
                if "role" in choice["delta"]:
                    assert i not in s.roles, f"two role chunks for choice {i}"
                    s.roles[i] = choice["delta"]["role"]
                text = choice["delta"].get("content") or ""
            else:
                text = choice["text"]
            s.texts[i] = s.texts.get(i, "") + text
            s.token_ids.setdefault(i, []).extend(choice.get("token_ids") or [])
            s.finish[i] = choice["finish_reason"]
    return s


def assert_openai_error(body: Any, status: int) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status."""
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)
    assert error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] == status, error
    return error


def chat_body(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"messages": CHAT_MESSAGES, "max_tokens": max_tokens, "ignore_eos": True, **extra}


# --------------------------------------------------------------------------------------------------
# /proc
# --------------------------------------------------------------------------------------------------


def proc_title(pid: int) -> str:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.split(b"\0", 1)[0].decode(errors="replace").strip()


def proc_children(pid: int) -> list[int]:
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except FileNotFoundError:  # the thread exited while we looked
            continue
    return sorted(children)


def proc_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat); None if it is gone/a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def proc_alive(pid: int, start_time: str) -> bool:
    """Is the process that had this start time still running (not a zombie, not a reused pid)?"""
    return proc_start_time(pid) == start_time


def ipc_dirs(pid: int) -> list[str]:
    root = tempfile.gettempdir()
    prefix = f"trioserve-{pid}-"
    return [name for name in os.listdir(root) if name.startswith(prefix)]
