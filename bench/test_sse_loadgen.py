"""Checks of the load generator's HTTP/SSE reader: ``pytest bench/test_sse_loadgen.py``."""

from __future__ import annotations

import random

import msgspec

from loadgen_loop import sample_lengths, word_prompts
from loadgen_report import steady_window
from loadgen_wire import (
    Counters,
    ResponseParser,
    WsResponseParser,
    backoff_seconds,
    parse_retry_after,
    ws_accept_key,
    ws_frame,
)


def _chunk_event(ids: list[int], content: str = "x") -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None, "token_ids": ids}
    sse = b"data: " + msgspec.json.encode({"object": "chat.completion.chunk", "choices": [choice]}) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(sse), sse)


def _response(events: list[list[int]]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    role = _chunk_event([], "")
    body = b"".join(_chunk_event(ids) for ids in events)
    done = b"data: [DONE]\n\n"
    return head + role + body + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)


def _feed_split(data: bytes, rng: random.Random, counters: Counters) -> ResponseParser:
    parser = ResponseParser(counters)
    pos = 0
    t = 0.0
    while pos < len(data):
        n = rng.randint(1, 40)
        parser.feed(data[pos : pos + n], t)
        pos += n
        t += 1.0
    return parser


def test_chunked_sse_any_split() -> None:
    rng = random.Random(1)
    events = [[i] for i in range(50)] + [[1, 2, 3], [4, 5]]
    data = _response(events)
    for _ in range(200):
        counters = Counters()
        parser = _feed_split(data, rng, counters)
        assert parser.complete and parser.done_seen and parser.error is None
        assert parser.keep_alive
        assert parser.tokens == 55
        assert counters.token_events == 52
        assert counters.sse_events == 53  # the role event carries no token
        assert counters.hist[1] == 50 and counters.hist[3] == 1 and counters.hist[2] == 1


def test_coalesced_events_in_one_chunk_and_crlf() -> None:
    sse = b"".join(
        b'data: {"choices":[{"delta":{"content":"a"},"token_ids":[%d]}]}\r\n\r\n' % i for i in range(3)
    )
    sse += b": keep-alive comment\r\n\r\ndata: [DONE]\r\n\r\n"
    data = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(sse), sse)
    )
    counters = Counters()
    parser = ResponseParser(counters)
    parser.feed(data, 0.0)
    assert parser.complete and parser.error is None and parser.tokens == 3
    assert not parser.keep_alive


def test_errors() -> None:
    counters = Counters()
    p = ResponseParser(counters)
    p.feed(b'HTTP/1.1 400 Bad Request\r\ncontent-length: 11\r\n\r\n{"error":1}', 0.0)
    assert p.complete and p.error == "http 400" and bytes(p.error_body) == b'{"error":1}'

    p = ResponseParser(counters)
    full = _response([[1], [2]])
    p.feed(full[: len(full) // 2], 0.0)
    p.eof(1.0)
    assert p.complete and p.error == "truncated stream"

    p = ResponseParser(counters)
    body = _chunk_event([1])
    p.feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n", 0.0)
    assert p.complete and p.error == "no [DONE]"


def test_retry_after_parse_and_rejection() -> None:
    assert parse_retry_after(b" 1 ") == 1.0
    assert parse_retry_after("2.5") == 2.5
    assert parse_retry_after(b"-3") == 0.0
    assert parse_retry_after(None) is None and parse_retry_after(b"soon") is None
    assert parse_retry_after(b"Wed, 21 Oct 2015 07:28:03 GMT", now=1445412480.0) == 3.0
    assert backoff_seconds(None) == 1.0 and backoff_seconds(60.0) == 5.0 and backoff_seconds(0.2) == 0.2

    p = ResponseParser(Counters())
    body = b'{"error":{"message":"busy","type":"rate_limit","code":429}}'
    p.feed(b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 2\r\ncontent-length: %d\r\n\r\n" % len(body), 0.0)
    p.feed(body, 0.0)
    assert p.complete and p.rejected and p.retry_after == 2.0 and p.keep_alive
    p = ResponseParser(Counters())
    p.feed(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n", 0.0)
    assert p.complete and not p.rejected and p.retry_after is None


def test_itl_events_and_completions_text() -> None:
    counters = Counters()
    p = ResponseParser(counters)
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    p.feed(head, 0.0)
    for t, ids in ((1.0, [1]), (1.5, [2, 3]), (3.0, [4])):
        p.feed(_chunk_event(ids), t)
    # A completions chunk without token_ids counts as one token.
    sse = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
    p.feed(b"%x\r\n%s\r\n" % (len(sse), sse), 3.25)
    done = b"data: [DONE]\n\n"
    p.feed(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done), 4.0)
    assert p.complete and p.error is None
    assert p.tokens == 5 and p.events == 4 and p.first_token_at == 1.0
    assert p.itl == [0.5, 1.5, 0.25]
    assert counters.no_token_ids == 1


def _ws_server_frame(payload: bytes, opcode: int = 0x1, fin: bool = True) -> bytes:
    n = len(payload)
    b0 = (0x80 if fin else 0) | opcode
    if n < 126:
        return bytes((b0, n)) + payload
    if n < 65536:
        return bytes((b0, 126)) + n.to_bytes(2, "big") + payload
    return bytes((b0, 127)) + n.to_bytes(8, "big") + payload


def test_websocket_messages_any_split() -> None:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}}]}
    frames = b""
    for i in range(40):
        c = dict(chunk, choices=[dict(chunk["choices"][0], token_ids=[i, i + 1] if i == 7 else [i])])
        frames += _ws_server_frame(msgspec.json.encode({"type": "chunk", "id": "3", "data": c}))
    # A long message fragmented in two, then a ping, then done.
    big = msgspec.json.encode({"type": "chunk", "id": "3", "data": dict(chunk, pad="y" * 300)})
    frames += _ws_server_frame(big[:100], 0x1, fin=False) + _ws_server_frame(big[100:], 0x0)
    frames += _ws_server_frame(b"hi", 0x9) + _ws_server_frame(b'{"type":"done","id":"3"}')
    rng = random.Random(2)
    for _ in range(100):
        counters = Counters()
        p = WsResponseParser(counters)
        pos = 0
        while pos < len(frames) and not p.complete:
            n = rng.randint(1, 60)
            p.feed(frames[pos : pos + n], float(pos))
            pos += n
        assert p.complete and p.done_seen and p.error is None and p.keep_alive
        assert p.tokens == 42 and p.events == 41 and counters.hist[2] == 1
        assert p.pong == ws_frame(0xA, b"hi")


def test_websocket_error_and_close() -> None:
    p = WsResponseParser(Counters())
    err = {"type": "error", "id": "1", "status": 503, "error": {"message": "busy", "code": 503}}
    p.feed(_ws_server_frame(msgspec.json.encode(err)), 0.0)
    assert p.complete and p.rejected and p.status == 503 and p.keep_alive
    p = WsResponseParser(Counters())
    p.feed(_ws_server_frame(b"\x03\xe8", 0x8), 0.0)
    assert p.complete and p.error == "websocket closed" and not p.keep_alive
    p = WsResponseParser(Counters())
    p.eof(0.0)
    assert p.complete and p.error == "truncated stream"


def test_ws_frame_and_accept_key() -> None:
    # RFC 6455 section 1.3's example.
    assert ws_accept_key(b"dGhlIHNhbXBsZSBub25jZQ==") == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    assert ws_frame(0x1, b"abc") == b"\x81\x83\0\0\0\0abc"
    assert ws_frame(0x1, b"a" * 200)[:4] == b"\x81\xfe\x00\xc8"
    assert ws_frame(0x1, b"a" * 70000)[:10] == b"\x81\xff" + (70000).to_bytes(8, "big")


def test_random_lengths() -> None:
    rng = random.Random(0)
    assert {sample_lengths(rng, 256, 0.0) for _ in range(10)} == {256}
    seen = [sample_lengths(rng, 100, 0.5) for _ in range(2000)]
    assert min(seen) == 50 and max(seen) == 150
    prompts = word_prompts(3, 5, 64, seed=1)
    assert len(prompts) == 3 and all(p.output_len == 64 and len(p.text.split()) == 7 for p in prompts)


def test_steady_window() -> None:
    # Ramp up, hold at >= 95 (target for 100 clients), one dip, drain.
    active = [0, 20, 60, 96, 100, 100, 90, 100, 97, 40, 0]
    assert steady_window(active, 95) == (3, 8, True)
    # Never reached: the window is where the count is >= 95% of its peak (60 -> 57).
    assert steady_window([0, 30, 58, 60, 59, 10], 95) == (2, 4, False)
    assert steady_window([], 95) == (0, 0, False)


def test_sse_probe_counts_token_ids_per_event() -> None:
    from sse_probe import tokens_per_event

    lines = [
        b'data: {"choices":[{"index":0,"text":"a","token_ids":[1]}]}\n',
        b"\n",
        b'data: {"choices":[{"index":0,"text":"bc","token_ids":[2,3]}]}\n',
        b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n',
        b'data: {"choices":[],"usage":{"completion_tokens":3}}\n',
        b"data: [DONE]\n",
    ]
    assert tokens_per_event(lines) == [1, 2, 0]
