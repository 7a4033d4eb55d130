"""Closed-loop load generator for streamed OpenAI chat completions.

Each of N clients keeps one HTTP/1.1 keep-alive connection, POSTs a streaming chat request, reads the SSE
stream to ``data: [DONE]`` and the end of the chunked body, and sends the next request at once. The HTTP
side is deliberately minimal so that the client is never the bottleneck: non-blocking stdlib sockets driven
by ``trio.lowlevel.wait_readable`` (one wakeup and one ``recv`` per arrival, no stream wrappers), a
hand-written status-line / header / chunked / SSE reader, and one ``msgspec`` decode per event into a
struct that only keeps ``choices[].token_ids`` and ``choices[].delta.content``.

A request refused with 429 or 503 (admission control) is counted as *rejected*, not as a failure, and that
client waits the response's ``Retry-After`` seconds (1 s if absent, at most ``--max-backoff``) before its
next request, as a real client backs off.

It measures over a steady-state window: client-side token and SSE-event counts, tokens per event, TTFT of
the requests sent inside the window, rejections, failures, and the CPU time (``utime + stime`` from
``/proc/PID/stat``) of any processes named with ``--watch NAME=PID`` plus its own.
The result is written as JSON.

Run standalone::

    python bench/sse_loadgen.py --port 8000 --clients 256 --output-len 256 --watch server=1234
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import errno
import math
import os
import random
import re
import resource
import select
import socket
import sys
import time
from collections.abc import Sequence

import msgspec
import trio

# ---------------------------------------------------------------------------------------------- /proc


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the ``comm`` field (index 0 is field 3, ``state``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of the whole thread group, in seconds; None if the process is gone."""
    fields = proc_stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def cpu_busy_seconds() -> dict[int, float]:
    """Busy time (everything but idle and iowait) of each CPU since boot, from /proc/stat."""
    out: dict[int, float] = {}
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *vals = line.split()
            ticks = [int(v) for v in vals]
            out[int(name[3:])] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / _CLK_TCK
    return out


# ------------------------------------------------------------------------------------------ parsing


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    token_ids: list[int] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    error: object = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode

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
        "first_token_at",
        "keep_alive",
        "last_token_at",
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
        self.first_token_at = 0.0
        self.last_token_at = 0.0

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
        n = 0
        for choice in chunk.choices:
            ids = choice.token_ids
            if ids is not None:
                n += len(ids)
            elif choice.delta is not None and choice.delta.content:
                n += 1
                counters.no_token_ids += 1
        if n:
            counters.tokens += n
            counters.token_events += 1
            counters.hist[n if n < HIST_MAX else HIST_MAX] += 1
            if not self.tokens:
                self.first_token_at = now
            self.last_token_at = now
            self.tokens += n


# ----------------------------------------------------------------------------------------- the load


class RequestRecord(msgspec.Struct, array_like=True):
    sent_at: float
    ttft: float  # seconds; nan if no token arrived
    ended_at: float
    tokens: int
    error: str | None


class LoadResult(msgspec.Struct):
    """What one load run measured. CPU figures are seconds of utime+stime inside the window."""

    url: str
    clients: int
    output_len: int
    window_s: float
    window_started_after_s: float
    tokens: int
    token_events: int
    sse_events: int
    tokens_per_event_hist: dict[int, int]
    no_token_ids_events: int
    bad_events: int
    requests_completed: int  # completed inside the window
    ttft_samples: int  # requests sent inside the window that got a first token
    ttft_missing: int  # ... that got none (failed, or still waiting after the grace period)
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    tpot_mean_ms: float
    wrong_length: int  # requests completed inside the window whose token count != output_len
    failures_window: dict[str, int]
    failures_total: dict[str, int]
    error_samples: list[str]
    inflight_min: int
    inflight_mean: float
    cpu_s: dict[str, float]  # watched processes (name -> seconds)
    cpu_gone: list[str]  # watched processes that died before the window ended
    client_cpu_s: float
    cpu_busy_s: dict[int, float]  # per CPU core: busy seconds in the window, every process included
    # Requests refused with 429/503 (by status: "429", "503"); not part of failures_*. The client
    # waited Retry-After (capped) before its next request.
    rejected_window: dict[str, int] = {}
    rejected_total: dict[str, int] = {}
    rejected_samples: list[str] = []  # up to 8 distinct refusal bodies (digits ignored when comparing)


class _Conn:
    """One client's connection in the epoll dispatcher."""

    __slots__ = ("fd", "idx", "out", "parser", "resume_at", "sent_at", "sock")

    def __init__(self, idx: int, sock: socket.socket) -> None:
        self.idx = idx
        self.sock = sock
        self.fd = sock.fileno()
        self.out = b""  # request bytes the socket did not take yet
        self.parser: ResponseParser | None = None
        self.sent_at = 0.0
        self.resume_at = 0.0  # perf_counter time a backing-off client may send again


class LoadGen:
    """N closed-loop clients, one keep-alive connection each.

    ``io="epoll"`` (default): one trio task owns an ``epoll`` set of all client sockets and waits on it
    with ``trio.lowlevel.wait_readable``; each wakeup drains every ready socket (one ``recv`` each) and
    sends follow-up requests inline, so the per-event cost is a ``recv`` plus the parse, with no task
    wakeup per event. ``io="tasks"``: one trio task per client, ``wait_readable`` + ``recv`` per arrival
    (about 2x the client CPU per event; kept for comparison).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        clients: int,
        model: str,
        output_len: int,
        input_words: int,
        io: str = "epoll",
        seed: int = 0,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.host = host
        self.port = port
        self.clients = clients
        self.output_len = output_len
        self.io = io
        self.counters = Counters()
        self.inflight = 0
        self.inflight_target = math.ceil(0.95 * clients)
        self.inflight_reached = trio.Event()
        self.records: list[RequestRecord] = []
        self.failures: dict[str, int] = {}
        self.rejected: dict[str, int] = {}  # by status, "429" / "503"
        self.rejected_samples: dict[str, str] = {}  # body with digits masked -> first such body
        self.max_backoff_s = max_backoff_s
        self.backing_off = 0  # clients waiting out a Retry-After (count as active for the window gate)
        self.error_samples: list[str] = []
        self.tpot_sum = 0.0
        self.tpot_n = 0
        # Per client: the request in flight and when it was sent (nan when none).
        self.current: list[ResponseParser | None] = [None] * clients
        self.current_sent_at: list[float] = [math.nan] * clients
        self._epoll: select.epoll | None = None
        self._conns: dict[int, _Conn] = {}
        self._nursery: trio.Nursery | None = None
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(512)]
        self.requests: list[bytes] = []
        for i in range(clients):
            prompt = f"client {i}: " + " ".join(rng.choice(words) for _ in range(input_words))
            body = msgspec.json.encode(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "stream": True,
                    "max_tokens": output_len,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
            )
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            self.requests.append(head + body)

    # -- bookkeeping shared by both I/O modes ------------------------------------------------------

    def _fail(self, kind: str, detail: str = "") -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if detail and len(self.error_samples) < 8:
            self.error_samples.append(f"{kind}: {detail}"[:300])

    def _begin(self, idx: int) -> tuple[ResponseParser, float]:
        parser = ResponseParser(self.counters)
        sent_at = time.perf_counter()
        self.current[idx] = parser
        self.current_sent_at[idx] = sent_at
        self.inflight += 1
        self._check_active()
        return parser, sent_at

    def _check_active(self) -> None:
        if self.inflight + self.backing_off >= self.inflight_target:
            self.inflight_reached.set()

    def _backoff(self, parser: ResponseParser | None) -> float:
        """Seconds the client waits before its next request: > 0 only after a 429/503."""
        if parser is None or not parser.complete or not parser.rejected:
            return 0.0
        return backoff_seconds(parser.retry_after, self.max_backoff_s)

    async def _sleep_backoff(self, delay: float) -> None:
        self.backing_off += 1
        self._check_active()
        try:
            await trio.sleep(delay)
        finally:
            self.backing_off -= 1

    def _end(self, idx: int, parser: ResponseParser, sent_at: float, io_error: str | None) -> bool:
        """Record a finished (or failed) request; returns whether the connection can be reused."""
        self.inflight -= 1
        self.current[idx] = None
        self.current_sent_at[idx] = math.nan
        error = io_error
        if error is not None:
            pass  # counted by the caller
        elif not parser.complete:
            error = "cancelled"
        elif parser.rejected:
            error = f"rejected {parser.status}"
            key = str(parser.status)
            self.rejected[key] = self.rejected.get(key, 0) + 1
            if len(self.rejected_samples) < 8:
                body = f"{parser.status} {bytes(parser.error_body).decode(errors='replace')}"[:300]
                self.rejected_samples.setdefault(re.sub(r"\d+", "N", body), body)
        elif parser.error is not None:
            error = parser.error
            detail = bytes(parser.error_body).decode(errors="replace")
            kind = error if error.startswith("http") or "error" in error else "truncated"
            self._fail(kind, f"{error} {detail}".strip())
        elif parser.tokens == 0:
            error = "no tokens"
            self._fail(error)
        ttft = parser.first_token_at - sent_at if parser.tokens else math.nan
        self.records.append(RequestRecord(sent_at, ttft, time.perf_counter(), parser.tokens, error))
        if parser.tokens > 1 and error is None:
            self.tpot_sum += (parser.last_token_at - parser.first_token_at) / (parser.tokens - 1)
            self.tpot_n += 1
        return error is None and parser.keep_alive

    async def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            err = sock.connect_ex((self.host, self.port))
            if err == errno.EINPROGRESS:
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except BaseException:
            sock.close()
            raise
        if err:
            sock.close()
            self._fail("connect", os.strerror(err))
            return None
        return sock

    async def _connected(self, idx: int, delay: float) -> socket.socket:
        await trio.sleep(delay)
        while True:
            sock = await self._connect()
            if sock is not None:
                return sock
            await trio.sleep(0.05)

    async def run(self, nursery: trio.Nursery, ramp_s: float) -> None:
        """Start every client (staggered over ``ramp_s``) in ``nursery``."""
        n = self.clients
        if self.io == "tasks":
            for i in range(n):
                nursery.start_soon(self._task_client, i, ramp_s * i / n)
            return
        self._nursery = nursery
        self._epoll = select.epoll()
        nursery.start_soon(self._dispatch)
        for i in range(n):
            nursery.start_soon(self._epoll_open, i, ramp_s * i / n)

    # -- io="tasks" --------------------------------------------------------------------------------

    async def _send_all(self, sock: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            view = view[n:]

    async def _task_client(self, idx: int, delay: float) -> None:
        sock: socket.socket | None = None
        try:
            while True:
                if sock is None:
                    sock = await self._connected(idx, delay)
                    delay = 0.0
                parser, sent_at = self._begin(idx)
                io_error: str | None = None
                try:
                    await self._send_all(sock, self.requests[idx])
                    while not parser.complete:
                        await trio.lowlevel.wait_readable(sock)
                        try:
                            data = sock.recv(65536)
                        except BlockingIOError:
                            continue
                        if data:
                            parser.feed(data, time.perf_counter())
                        else:
                            parser.eof(time.perf_counter())
                except OSError as e:
                    io_error = "send/recv error"
                    self._fail(io_error, str(e))
                finally:
                    reuse = self._end(idx, parser, sent_at, io_error)
                if not reuse:
                    sock.close()
                    sock = None
                backoff = self._backoff(parser)
                if backoff > 0:
                    await self._sleep_backoff(backoff)
        finally:
            if sock is not None:
                sock.close()

    # -- io="epoll" --------------------------------------------------------------------------------

    async def _epoll_open(self, idx: int, delay: float, backoff: float = 0.0) -> None:
        if backoff > 0:
            await self._sleep_backoff(backoff)
        sock = await self._connected(idx, delay)
        assert self._epoll is not None
        conn = _Conn(idx, sock)
        self._conns[conn.fd] = conn
        self._epoll.register(conn.fd, select.EPOLLIN)
        self._epoll_send(conn)

    def _epoll_send(self, conn: _Conn) -> None:
        """Start the next request on ``conn``."""
        conn.parser, conn.sent_at = self._begin(conn.idx)
        data = self.requests[conn.idx]
        try:
            n = conn.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._epoll_drop(conn, "send/recv error", str(e))
            return
        if n < len(data):
            conn.out = data[n:]
            assert self._epoll is not None
            self._epoll.modify(conn.fd, select.EPOLLIN | select.EPOLLOUT)

    async def _epoll_send_later(self, conn: _Conn, backoff: float) -> None:
        """Wait out a Retry-After, then send the next request on ``conn`` if it is still open."""
        await self._sleep_backoff(backoff)
        if self._conns.get(conn.fd) is conn and conn.parser is None:
            self._epoll_send(conn)

    def _epoll_drop(
        self, conn: _Conn, io_error: str | None = None, detail: str = "", backoff: float = 0.0
    ) -> None:
        """Close ``conn`` (recording its request if one is open) and reconnect that client (after
        ``backoff`` seconds)."""
        if io_error is not None:
            self._fail(io_error, detail)
        backoff = max(backoff, conn.resume_at - time.perf_counter())
        if conn.parser is not None:
            self._end(conn.idx, conn.parser, conn.sent_at, io_error)
            conn.parser = None
        assert self._epoll is not None and self._nursery is not None
        self._conns.pop(conn.fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(conn.fd)
        conn.sock.close()
        self._nursery.start_soon(self._epoll_open, conn.idx, 0.0, backoff)

    def _epoll_writable(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except BlockingIOError:
            return
        except OSError as e:
            self._epoll_drop(conn, "send/recv error", str(e))
            return
        conn.out = conn.out[n:]
        if not conn.out:
            assert self._epoll is not None
            self._epoll.modify(conn.fd, select.EPOLLIN)

    def _epoll_readable(self, conn: _Conn) -> None:
        parser = conn.parser
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            self._epoll_drop(conn, "send/recv error", str(e))
            return
        if parser is None:  # bytes (or EOF) between requests: the server closed or misbehaved
            self._epoll_drop(conn, "unexpected data" if data else None, repr(data[:80]))
            return
        if data:
            parser.feed(data, time.perf_counter())
        else:
            parser.eof(time.perf_counter())
        if parser.complete:
            conn.parser = None
            backoff = self._backoff(parser)
            if not self._end(conn.idx, parser, conn.sent_at, None):
                self._epoll_drop(conn, backoff=backoff)
            elif backoff > 0:
                conn.resume_at = time.perf_counter() + backoff
                assert self._nursery is not None
                self._nursery.start_soon(self._epoll_send_later, conn, backoff)
            else:
                self._epoll_send(conn)

    async def _dispatch(self) -> None:
        ep = self._epoll
        assert ep is not None
        conns = self._conns
        readable = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
        try:
            while True:
                await trio.lowlevel.wait_readable(ep)
                for fd, mask in ep.poll(0, 4096):
                    conn = conns.get(fd)
                    if conn is None:
                        continue
                    if mask & select.EPOLLOUT and conn.out:
                        self._epoll_writable(conn)
                        if conns.get(fd) is not conn:
                            continue
                    if mask & readable:
                        self._epoll_readable(conn)
        finally:
            for conn in list(conns.values()):
                conn.sock.close()
            conns.clear()
            ep.close()


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


async def run_load(
    gen: LoadGen,
    *,
    ramp_s: float,
    warmup_s: float,
    duration_s: float,
    watch: dict[str, int],
    grace_s: float = 10.0,
    log: bool = True,
) -> LoadResult:
    """Start the clients staggered over ``ramp_s``; after ``warmup_s`` and once 95% of the clients have
    a request in flight, measure a ``duration_s`` window; then stop every client."""

    def say(msg: str) -> None:
        if log:
            print(f"[loadgen] {msg}", file=sys.stderr, flush=True)

    def cpu_all() -> dict[str, float | None]:
        return {name: proc_cpu_seconds(pid) for name, pid in watch.items()}

    n = gen.clients
    async with trio.open_nursery() as nursery:
        t_start = time.perf_counter()
        await gen.run(nursery, ramp_s)
        await trio.sleep(warmup_s)
        with trio.move_on_after(30.0):
            await gen.inflight_reached.wait()
        if gen.inflight < gen.inflight_target:
            say(f"only {gen.inflight}/{n} requests in flight after warm-up; measuring anyway")

        c0 = gen.counters.snapshot()
        fails0 = dict(gen.failures)
        rej0 = dict(gen.rejected)
        rec0 = len(gen.records)
        cpu0 = cpu_all()
        busy0 = cpu_busy_seconds()
        self0 = time.process_time()
        t0 = time.perf_counter()
        say(f"window opens {t0 - t_start:.1f}s in, {gen.inflight} in flight; measuring {duration_s:g}s")
        infl: list[int] = []
        t_end = t0 + duration_s
        while (now := time.perf_counter()) < t_end:
            infl.append(gen.inflight)
            await trio.sleep(min(0.1, t_end - now))
        c1 = gen.counters.snapshot()
        cpu1 = cpu_all()
        busy1 = cpu_busy_seconds()
        self1 = time.process_time()
        t1 = time.perf_counter()
        fails1 = dict(gen.failures)
        rej1 = dict(gen.rejected)
        rec1 = len(gen.records)

        # Requests sent inside the window and still in flight: wait (up to grace_s) for their first
        # token so that a slow TTFT is measured rather than dropped.
        def unfinished_in_window() -> list[tuple[float, ResponseParser]]:
            out = []
            for s, p in zip(gen.current_sent_at, gen.current, strict=True):
                if p is not None and t0 <= s <= t1:
                    out.append((s, p))
            return out

        for _ in range(math.ceil(grace_s / 0.05)):
            if all(p.tokens for _, p in unfinished_in_window()):
                break
            await trio.sleep(0.05)
        pending = unfinished_in_window()
        nursery.cancel_scope.cancel()

    ttfts: list[float] = []
    missing = 0
    for r in gen.records:
        if t0 <= r.sent_at <= t1 and r.error != "cancelled" and not (r.error or "").startswith("rejected"):
            if math.isnan(r.ttft):
                missing += 1
            else:
                ttfts.append(r.ttft)
    for s, p in pending:
        if p.tokens:
            ttfts.append(p.first_token_at - s)
        else:
            missing += 1
    ttfts.sort()
    completed = gen.records[rec0:rec1]
    window = t1 - t0
    hist = {k: c1.hist[k] - c0.hist[k] for k in range(HIST_MAX + 1) if c1.hist[k] != c0.hist[k]}
    cpu: dict[str, float] = {}
    gone: list[str] = []
    for name in watch:
        a, b = cpu0[name], cpu1[name]
        if a is None or b is None:
            gone.append(name)
        else:
            cpu[name] = b - a
    return LoadResult(
        url=f"http://{gen.host}:{gen.port}",
        clients=n,
        output_len=gen.output_len,
        window_s=window,
        window_started_after_s=t0 - t_start,
        tokens=c1.tokens - c0.tokens,
        token_events=c1.token_events - c0.token_events,
        sse_events=c1.sse_events - c0.sse_events,
        tokens_per_event_hist=hist,
        no_token_ids_events=c1.no_token_ids - c0.no_token_ids,
        bad_events=c1.bad_events - c0.bad_events,
        requests_completed=sum(1 for r in completed if r.error is None),
        ttft_samples=len(ttfts),
        ttft_missing=missing,
        ttft_p50_ms=_percentile(ttfts, 0.50) * 1e3,
        ttft_p90_ms=_percentile(ttfts, 0.90) * 1e3,
        ttft_p99_ms=_percentile(ttfts, 0.99) * 1e3,
        ttft_max_ms=ttfts[-1] * 1e3 if ttfts else math.nan,
        tpot_mean_ms=gen.tpot_sum / gen.tpot_n * 1e3 if gen.tpot_n else math.nan,
        wrong_length=sum(1 for r in completed if r.error is None and r.tokens != gen.output_len),
        failures_window={k: v - fails0.get(k, 0) for k, v in fails1.items() if v != fails0.get(k, 0)},
        failures_total={k: v for k, v in gen.failures.items()},
        error_samples=gen.error_samples,
        inflight_min=min(infl) if infl else 0,
        inflight_mean=sum(infl) / len(infl) if infl else 0.0,
        cpu_s=cpu,
        cpu_gone=gone,
        client_cpu_s=self1 - self0,
        cpu_busy_s={c: busy1[c] - busy0[c] for c in busy1 if c in busy0},
        rejected_window={k: v - rej0.get(k, 0) for k, v in rej1.items() if v != rej0.get(k, 0)},
        rejected_total=dict(gen.rejected),
        rejected_samples=list(gen.rejected_samples.values()),
    )


def raise_nofile_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _parse_watch(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, _, pid = item.partition("=")
        out[name] = int(pid)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="mock")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--input-words", type=int, default=200)
    ap.add_argument("--ramp", type=float, default=1.0, help="stagger connection starts over this many s")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window may open")
    ap.add_argument("--duration", type=float, default=10.0, help="measurement window, seconds")
    ap.add_argument("--grace", type=float, default=10.0, help="max wait for in-window TTFTs")
    ap.add_argument("--watch", action="append", default=[], metavar="NAME=PID", help="measure CPU of PID")
    ap.add_argument("--io", choices=("epoll", "tasks"), default="epoll", help="client I/O strategy")
    ap.add_argument(
        "--max-backoff", type=float, default=MAX_BACKOFF_S, help="cap on the Retry-After wait after 429/503"
    )
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU core")
    ap.add_argument("--result-file", default=None, help="write the JSON result here (default: stdout)")
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    raise_nofile_limit()
    gen = LoadGen(
        host=args.host,
        port=args.port,
        clients=args.clients,
        model=args.model,
        output_len=args.output_len,
        input_words=args.input_words,
        io=args.io,
        max_backoff_s=args.max_backoff,
    )
    result = trio.run(
        lambda: run_load(
            gen,
            ramp_s=args.ramp,
            warmup_s=args.warmup,
            duration_s=args.duration,
            watch=_parse_watch(args.watch),
            grace_s=args.grace,
        )
    )
    data = msgspec.json.encode(result)
    if args.result_file:
        with open(args.result_file, "wb") as f:
            f.write(data)
    else:
        sys.stdout.buffer.write(msgspec.json.format(data) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
