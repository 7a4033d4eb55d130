"""The load generator's closed loop: prompts, connections and pacing (``bench/sse_loadgen.py``).

``word_prompts`` and ``token_prompts`` make the prompts. ``LoadGen`` runs N closed-loop clients, one
keep-alive connection each (one ``epoll`` set for all of them, or one trio task per client): it sends a
request, feeds what arrives to a reader from ``loadgen_wire``, records the request as a
``loadgen_report.RequestRecord``, waits out a 429/503's ``Retry-After`` and sends the next one.
``run_load`` (a fixed window after warm-up) and ``run_prompts`` (``--num-prompts``: the steady-state
window) drive it and build the ``LoadResult``. The module layering: ``loadgen_wire`` and
``loadgen_report`` at the bottom, this module above both, ``sse_loadgen`` (the command line) on top.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import math
import os
import random
import re
import select
import socket
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio

from loadgen_report import (
    LoadResult,
    RequestRecord,
    _itl_ms,
    _or_none,
    _percentile,
    cpu_busy_seconds,
    proc_cpu_seconds,
    steady_window,
)
from loadgen_wire import (
    HIST_MAX,
    MAX_BACKOFF_S,
    Counters,
    ResponseParser,
    WsResponseParser,
    backoff_seconds,
    ws_accept_key,
    ws_frame,
)


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


@dataclass(slots=True)
class Prompt:
    text: str
    output_len: int  # max_tokens
    input_tokens: int = -1  # -1: not tokenized (word prompts)


def sample_lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    """vllm-bench's random lengths: uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    if range_ratio <= 0:
        return max(1, mean)
    lo = max(1, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def word_prompts(
    n: int, input_words: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[Prompt]:
    """The original prompt shape: ``client i:`` and ``input_words`` random lowercase words."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(512)]
    return [
        Prompt(
            f"client {i}: " + " ".join(rng.choice(words) for _ in range(input_words)),
            sample_lengths(rng, output_len, range_ratio),
        )
        for i in range(n)
    ]


def default_tokenizer_path() -> Path:
    """The built-in Qwen3 tokenizer that ``trioserve`` caches (built on first use, a few seconds)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "trioserve" / "tokenizers" / "qwen3"
    if not (folder / "tokenizer.json").exists():
        from trioserve.frontend.text.tokenizer import load_tokenizer  # slow import; only to build the cache

        load_tokenizer(None)
    return folder


def token_prompts(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    tokenizer_path: str | None,
    seed: int = 0,
) -> list[Prompt]:
    """Prompts of an exact token count (vllm-bench's random dataset, up to the chat template).

    Each prompt is a run of vocabulary entries of the form `` word`` (space, 2-10 ASCII letters) that
    encode back to exactly one token, so concatenating k of them encodes to exactly k tokens (the
    pre-tokenizer splits at each space). Input lengths are checked by encoding every prompt.
    """
    from tokenizers import Tokenizer  # the Rust tokenizer only: 1-2 s, not transformers' 10+

    path = Path(tokenizer_path) if tokenizer_path else default_tokenizer_path()
    if path.is_dir():
        path = path / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    rng = random.Random(seed)
    word = re.compile(r"^ [A-Za-z]{2,10}$")
    pool: list[str] = []
    vocab = tok.get_vocab_size(with_added_tokens=False)
    for i in rng.sample(range(vocab), min(vocab, 20000)):
        text = tok.decode([i])
        if word.match(text) and tok.encode(text, add_special_tokens=False).ids == [i]:
            pool.append(text)
    if len(pool) < 100:
        raise RuntimeError(f"{path}: too few single-token words to build random prompts")
    out: list[Prompt] = []
    for _ in range(n):
        k = sample_lengths(rng, input_len, range_ratio)
        text = "".join(rng.choice(pool) for _ in range(k))
        out.append(Prompt(text, sample_lengths(rng, output_len, range_ratio), k))
    counts = tok.encode_batch([p.text for p in out], add_special_tokens=False)
    for p, enc in zip(out, counts, strict=True):
        p.input_tokens = len(enc.ids)
    return out


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
        input_words: int = 200,
        io: str = "epoll",
        seed: int = 0,
        max_backoff_s: float = MAX_BACKOFF_S,
        prompts: list[Prompt] | None = None,
        num_prompts: int | None = None,
        endpoint: str = "chat",
        transport: str = "sse",
        ignore_eos: bool = True,
        ws_path: str = "/v1/ws",
        list_models_first: bool = False,
        logprobs: int | None = None,
    ) -> None:
        """``logprobs``: ask for logprobs with this many alternatives per token (chat: logprobs and
        top_logprobs; completions: logprobs); None: none."""
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint {endpoint!r}: chat or completions")
        if transport not in ("sse", "ws"):
            raise ValueError(f"transport {transport!r}: sse or ws")
        self.host = host
        self.port = port
        self.clients = clients
        self.output_len = output_len
        self.io = io
        self.endpoint = endpoint
        self.transport = transport
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.ws_path = ws_path
        self.list_models_first = list_models_first  # as the openai SDK's pooled connections do
        self.num_prompts = num_prompts  # None: unbounded (duration mode)
        self.sent = 0  # requests started (each takes the next prompt)
        self.stopped_clients = 0  # clients done because every prompt was sent
        self.all_done = trio.Event()
        self.connect_failures = 0
        self.t_start = math.nan  # perf_counter time of run()
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
        self.current_prompt: list[int] = [-1] * clients
        self._epoll: select.epoll | None = None
        self._conns: dict[int, _Conn] = {}
        self._nursery: trio.Nursery | None = None
        if prompts is None:
            prompts = word_prompts(max(clients, num_prompts or 0), input_words, output_len, seed=seed)
        if not prompts:
            raise ValueError("no prompts")
        self.prompts = prompts
        # Pre-encoded: the whole HTTP request (SSE), or the request body (WebSocket: framed per send
        # with a fresh id).
        self.requests: list[bytes] = [self._encode(p, model, host, port) for p in prompts]

    def _encode(self, prompt: Prompt, model: str, host: str, port: int) -> bytes:
        body: dict[str, object] = {"model": model}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        body.update(
            stream=True, max_tokens=prompt.output_len, ignore_eos=self.ignore_eos, return_token_ids=True
        )
        if self.logprobs is not None:
            if self.endpoint == "chat":
                body.update(logprobs=True, top_logprobs=self.logprobs)
            else:
                body["logprobs"] = self.logprobs
        data = msgspec.json.encode(body)
        if self.transport == "ws":
            return data
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        return head + data

    def _request_bytes(self, k: int, p: int) -> bytes:
        if self.transport == "sse":
            return self.requests[p]
        endpoint = b"chat.completions" if self.endpoint == "chat" else b"completions"
        msg = b'{"type":"request","id":"%d","endpoint":"%s","body":%s}' % (k, endpoint, self.requests[p])
        return ws_frame(0x1, msg)

    # -- bookkeeping shared by both I/O modes ------------------------------------------------------

    def _fail(self, kind: str, detail: str = "") -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if detail and len(self.error_samples) < 8:
            self.error_samples.append(f"{kind}: {detail}"[:300])

    def _exhausted(self) -> bool:
        return self.num_prompts is not None and self.sent >= self.num_prompts

    def _begin(self, idx: int) -> tuple[ResponseParser, float, bytes] | None:
        """Take the next prompt for client ``idx``: its parser, send time and request bytes; None when
        every prompt has been sent (the client then stops)."""
        if self._exhausted():
            return None
        k = self.sent
        self.sent += 1
        p = k % len(self.prompts)
        parser = WsResponseParser(self.counters) if self.transport == "ws" else ResponseParser(self.counters)
        sent_at = time.perf_counter()
        self.current[idx] = parser
        self.current_sent_at[idx] = sent_at
        self.current_prompt[idx] = p
        self.inflight += 1
        self._check_active()
        return parser, sent_at, self._request_bytes(k, p)

    def _client_stopped(self) -> None:
        self.stopped_clients += 1
        if self.stopped_clients >= self.clients:
            self.all_done.set()

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
        prompt = self.current_prompt[idx]
        self.current[idx] = None
        self.current_sent_at[idx] = math.nan
        self.current_prompt[idx] = -1
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
        self.records.append(
            RequestRecord(
                sent_at,
                ttft,
                time.perf_counter(),
                parser.tokens,
                error,
                prompt,
                parser.events,
                array("d", parser.itl),
            )
        )
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
            if not err and self.transport == "ws":
                why = await self._ws_handshake(sock)
                if why is not None:
                    sock.close()
                    self._fail("ws handshake", why)
                    return None
            elif not err and self.list_models_first:
                why = await self._list_models(sock)
                if why is not None:
                    sock.close()
                    self._fail("GET /v1/models", why)
                    return None
        except BaseException:
            sock.close()
            raise
        if err:
            sock.close()
            self.connect_failures += 1
            self._fail("connect", os.strerror(err))
            return None
        return sock

    async def _list_models(self, sock: socket.socket) -> str | None:
        """``GET /v1/models`` on a fresh keep-alive connection before its first completion, as an
        SDK client that listed the models first would; returns why it failed, or None."""
        req = f"GET /v1/models HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        try:
            await self._send_all(sock, req)
            buf = b""
            length = -1
            while length < 0 or len(buf) < length:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                if not data:
                    return "closed before the response ended"
                buf += data
                if length < 0 and b"\r\n\r\n" in buf:
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    if head.split(b" ")[1:2] != [b"200"]:
                        return head.split(b"\r\n")[0].decode(errors="replace")
                    sizes = [
                        ln.split(b":", 1)[1]
                        for ln in head.lower().split(b"\r\n")
                        if ln.startswith(b"content-length:")
                    ]
                    if not sizes:
                        return "no content-length"
                    length = int(sizes[0])
        except OSError as e:
            return str(e)
        return None if len(buf) == length else "data after the response"

    async def _ws_handshake(self, sock: socket.socket) -> str | None:
        """Upgrade a fresh connection to a WebSocket; returns why it failed, or None."""
        key = base64.b64encode(random.randbytes(16))
        req = (
            f"GET {self.ws_path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key.decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        try:
            await self._send_all(sock, req)
            buf = b""
            while b"\r\n\r\n" not in buf:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                if not data:
                    return "closed during the handshake"
                buf += data
        except OSError as e:
            return str(e)
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        if lines[0].split(b" ")[1:2] != [b"101"]:
            return lines[0].decode(errors="replace")
        accept = ws_accept_key(key)
        if not any(
            ln.lower().startswith(b"sec-websocket-accept:") and ln.split(b":", 1)[1].strip() == accept
            for ln in lines[1:]
        ):
            return "bad Sec-WebSocket-Accept"
        if rest:
            return "data after the handshake"
        return None

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
        self.t_start = time.perf_counter()
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
                if self._exhausted():
                    break
                if sock is None:
                    sock = await self._connected(idx, delay)
                    delay = 0.0
                begun = self._begin(idx)
                if begun is None:
                    break
                parser, sent_at, request = begun
                io_error: str | None = None
                try:
                    await self._send_all(sock, request)
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
                        if parser.pong:
                            pong, parser.pong = parser.pong, b""
                            await self._send_all(sock, pong)
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
            self._client_stopped()
        finally:
            if sock is not None:
                sock.close()

    # -- io="epoll" --------------------------------------------------------------------------------

    async def _epoll_open(self, idx: int, delay: float, backoff: float = 0.0) -> None:
        if backoff > 0:
            await self._sleep_backoff(backoff)
        if self._exhausted():
            self._client_stopped()
            return
        sock = await self._connected(idx, delay)
        assert self._epoll is not None
        conn = _Conn(idx, sock)
        self._conns[conn.fd] = conn
        self._epoll.register(conn.fd, select.EPOLLIN)
        self._epoll_send(conn)

    def _epoll_close(self, conn: _Conn) -> None:
        assert self._epoll is not None
        self._conns.pop(conn.fd, None)
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(conn.fd)
        conn.sock.close()

    def _epoll_send(self, conn: _Conn) -> None:
        """Start the next request on ``conn`` (or close it and stop its client: no prompts left)."""
        begun = self._begin(conn.idx)
        if begun is None:
            self._epoll_close(conn)
            self._client_stopped()
            return
        conn.parser, conn.sent_at, data = begun
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
        assert self._nursery is not None
        self._epoll_close(conn)
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
        if parser.pong:  # best effort: a pong the socket cannot take now is dropped
            with contextlib.suppress(OSError):
                conn.sock.send(parser.pong)
            parser.pong = b""
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
        cpu_start = time.process_time()
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
        unix0 = time.time()
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
        unix1 = time.time()
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
    in_window = [r for r in gen.records if t0 <= r.sent_at <= t1 and r.error is None]
    itl = _itl_ms(in_window)
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
        mode="duration",
        transport=gen.transport,
        endpoint=gen.endpoint,
        requests_sent=gen.sent,
        requests_ok=sum(1 for r in gen.records if r.error is None),
        run_s=time.perf_counter() - t_start,
        inflight_target=gen.inflight_target,
        steady_state=gen.inflight_reached.is_set(),
        window_start_unix=unix0,
        window_end_unix=unix1,
        ttft_mean_ms=sum(ttfts) / len(ttfts) * 1e3 if ttfts else None,
        itl_samples=len(itl),
        itl_p50_ms=_or_none(_percentile(itl, 0.50)),
        itl_p90_ms=_or_none(_percentile(itl, 0.90)),
        itl_p99_ms=_or_none(_percentile(itl, 0.99)),
        tpot_samples=gen.tpot_n,
        input_tokens_mean=_mean_input_tokens(gen),
        output_len_mean=sum(p.output_len for p in gen.prompts) / len(gen.prompts),
        ignore_eos=gen.ignore_eos,
        client_cpu_total_s=time.process_time() - cpu_start,
    )


def _mean_input_tokens(gen: LoadGen) -> float | None:
    counts = [p.input_tokens for p in gen.prompts if p.input_tokens >= 0]
    return sum(counts) / len(counts) if counts else None


@dataclass(slots=True)
class _Sample:
    t: float  # perf_counter
    unix: float
    active: int
    inflight: int
    counters: Counters
    failures: dict[str, int]
    rejected: dict[str, int]
    cpu: dict[str, float | None]
    client_cpu: float
    busy: dict[int, float]


async def run_prompts(
    gen: LoadGen,
    *,
    ramp_s: float,
    watch: dict[str, int],
    max_duration_s: float = 600.0,
    sample_s: float = 0.1,
    progress_s: float = 5.0,
    log: bool = True,
) -> LoadResult:
    """Send ``gen.num_prompts`` requests with at most ``gen.clients`` in flight (first connections
    staggered over ``ramp_s``), sampling counters and /proc CPU every ``sample_s``; the result covers the
    steady-state window (see ``steady_window``). Stops after ``max_duration_s`` even if prompts remain."""
    assert gen.num_prompts is not None

    def say(msg: str) -> None:
        if log:
            print(f"[loadgen] {msg}", file=sys.stderr, flush=True)

    def sample() -> _Sample:
        return _Sample(
            time.perf_counter(),
            time.time(),
            gen.inflight + gen.backing_off,
            gen.inflight,
            gen.counters.snapshot(),
            dict(gen.failures),
            dict(gen.rejected),
            {name: proc_cpu_seconds(pid) for name, pid in watch.items()},
            time.process_time(),
            cpu_busy_seconds(),
        )

    samples: list[_Sample] = []
    cut_short = False
    async with trio.open_nursery() as nursery:
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        await gen.run(nursery, ramp_s)
        next_progress = t_start + progress_s
        while True:
            samples.append(sample())
            now = samples[-1].t
            if gen.all_done.is_set():
                break
            if now - t_start > max_duration_s:
                cut_short = True
                say(f"stopping after {max_duration_s:g}s with {gen.num_prompts - gen.sent} prompts unsent")
                break
            if now >= next_progress:
                next_progress += progress_s
                say(
                    f"{now - t_start:5.1f}s: {len(gen.records)}/{gen.num_prompts} done, "
                    f"{gen.inflight} in flight, {gen.counters.tokens} tokens"
                )
            with trio.move_on_after(sample_s):
                await gen.all_done.wait()
        nursery.cancel_scope.cancel()
    t_end = time.perf_counter()
    client_cpu_total = time.process_time() - cpu_start

    first, last, reached = steady_window([s.active for s in samples], gen.inflight_target)
    a, b = samples[first], samples[last]
    if not reached:
        say(
            f"fewer than {gen.inflight_target}/{gen.clients} clients were ever in flight; "
            "window at 95% of the peak"
        )
    t0, t1 = a.t, b.t
    window = t1 - t0
    say(f"steady window {t0 - t_start:.1f}s to {t1 - t_start:.1f}s of {t_end - t_start:.1f}s")
    sent_in = [r for r in gen.records if t0 <= r.sent_at <= t1]
    ok_in = [r for r in sent_in if r.error is None]
    ttfts = sorted(
        r.ttft for r in sent_in if not math.isnan(r.ttft) and not (r.error or "").startswith("rejected")
    )
    missing = sum(1 for r in sent_in if math.isnan(r.ttft) and not (r.error or "").startswith("rejected"))
    tpots = [(sum(r.itl) / (r.tokens - 1)) for r in ok_in if r.tokens > 1 and r.itl]
    itl = _itl_ms(ok_in)
    completed = [r for r in gen.records if t0 <= r.ended_at <= t1]
    prompts = gen.prompts
    wrong = (
        sum(1 for r in completed if r.error is None and r.tokens != prompts[r.prompt].output_len)
        if gen.ignore_eos
        else sum(1 for r in completed if r.error is None and r.tokens > prompts[r.prompt].output_len)
    )
    hist = {
        k: b.counters.hist[k] - a.counters.hist[k]
        for k in range(HIST_MAX + 1)
        if b.counters.hist[k] != a.counters.hist[k]
    }
    cpu: dict[str, float] = {}
    gone: list[str] = []
    for name in watch:
        c0, c1 = a.cpu[name], b.cpu[name]
        if c0 is None or c1 is None:
            gone.append(name)
        else:
            cpu[name] = c1 - c0
    if cut_short:
        gen.error_samples.append(f"run cut short after {max_duration_s:g}s")
    window_samples = samples[first : last + 1]
    return LoadResult(
        url=f"http://{gen.host}:{gen.port}",
        clients=gen.clients,
        output_len=gen.output_len,
        window_s=window,
        window_started_after_s=t0 - t_start,
        tokens=b.counters.tokens - a.counters.tokens,
        token_events=b.counters.token_events - a.counters.token_events,
        sse_events=b.counters.sse_events - a.counters.sse_events,
        tokens_per_event_hist=hist,
        no_token_ids_events=b.counters.no_token_ids - a.counters.no_token_ids,
        bad_events=b.counters.bad_events - a.counters.bad_events,
        requests_completed=sum(1 for r in completed if r.error is None),
        ttft_samples=len(ttfts),
        ttft_missing=missing,
        ttft_p50_ms=_percentile(ttfts, 0.50) * 1e3,
        ttft_p90_ms=_percentile(ttfts, 0.90) * 1e3,
        ttft_p99_ms=_percentile(ttfts, 0.99) * 1e3,
        ttft_max_ms=ttfts[-1] * 1e3 if ttfts else math.nan,
        tpot_mean_ms=sum(tpots) / len(tpots) * 1e3 if tpots else math.nan,
        wrong_length=wrong,
        failures_window={
            k: v - a.failures.get(k, 0) for k, v in b.failures.items() if v != a.failures.get(k, 0)
        },
        failures_total=dict(gen.failures),
        error_samples=gen.error_samples,
        inflight_min=min(s.inflight for s in window_samples),
        inflight_mean=sum(s.inflight for s in window_samples) / len(window_samples),
        cpu_s=cpu,
        cpu_gone=gone,
        client_cpu_s=b.client_cpu - a.client_cpu,
        cpu_busy_s={c: b.busy[c] - a.busy[c] for c in b.busy if c in a.busy},
        rejected_window={
            k: v - a.rejected.get(k, 0) for k, v in b.rejected.items() if v != a.rejected.get(k, 0)
        },
        rejected_total=dict(gen.rejected),
        rejected_samples=list(gen.rejected_samples.values()),
        mode="num-prompts",
        transport=gen.transport,
        endpoint=gen.endpoint,
        num_prompts=gen.num_prompts,
        requests_sent=gen.sent,
        requests_ok=sum(1 for r in gen.records if r.error is None),
        run_s=t_end - t_start,
        inflight_target=gen.inflight_target,
        steady_state=reached and last > first,
        window_start_unix=a.unix,
        window_end_unix=b.unix,
        ttft_mean_ms=sum(ttfts) / len(ttfts) * 1e3 if ttfts else None,
        itl_samples=len(itl),
        itl_p50_ms=_or_none(_percentile(itl, 0.50)),
        itl_p90_ms=_or_none(_percentile(itl, 0.90)),
        itl_p99_ms=_or_none(_percentile(itl, 0.99)),
        tpot_samples=len(tpots),
        input_tokens_mean=_mean_input_tokens(gen),
        output_len_mean=sum(p.output_len for p in prompts) / len(prompts),
        ignore_eos=gen.ignore_eos,
        client_cpu_total_s=client_cpu_total,
    )
