"""Checks of the load generator's HTTP/SSE reader: ``pytest bench/test_sse_loadgen.py``."""

from __future__ import annotations

import random

import msgspec

from sse_loadgen import Counters, ResponseParser, backoff_seconds, parse_retry_after


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
