"""Raw HTTP/1.x over a trio socket: the bytes ``curl -N`` sees, framing, keep-alive, bad input.

The server's own h11 loop owns every connection and serves the generation routes itself, whatever
came before a request on its connection; other routes go to the quart app per request. Several tests
run both on a fresh connection and on one that listed the models first (as the openai SDK's pooled
connections do), and every SSE response must carry the fast path's own header.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import trio

from ._support import (
    CHAT_MESSAGES,
    RawHttp,
    RawResponse,
    assert_openai_error,
    chat_body,
    http_request,
    parse_sse,
    post,
    sse_chunks,
    summarize,
)
from .conftest import MAX_MODEL_LEN, MODEL, ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIMEOUT = 30


async def connect(server: ServerProcess, path_kind: str = "fast") -> RawHttp:
    """A connection; for ``models_first`` it has served a ``GET /v1/models`` already."""
    conn = await RawHttp.connect(server.host, server.port)
    if path_kind == "models_first":
        await conn.send(http_request("GET", "/v1/models"))
        models = await conn.read_response()
        assert models.status == 200
        assert models.json()["object"] == "list"
    return conn


def assert_sse_response(response: RawResponse, *, chunked: bool = True) -> list[dict[str, Any]]:
    assert response.status == 200, response.body
    assert (response.header("content-type") or "").startswith("text/event-stream")
    assert response.header("x-accel-buffering") == "no"  # only the fast path's SSE head has it
    assert response.framing == ("chunked" if chunked else "close")
    return sse_chunks(response.body)


def assert_error_response(response: RawResponse, status: int) -> dict[str, Any]:
    assert response.status == status, (response.status, response.body[:300])
    assert (response.header("content-type") or "").startswith("application/json")
    return assert_openai_error(response.json(), status)


# ---- framing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
async def test_chunked_sse_framing(server: ServerProcess, path_kind: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server, path_kind) as conn:
            body = chat_body(
                6, stream=True, stream_options={"include_usage": True}, return_token_ids=True, n=2
            )
            await conn.send(post(CHAT, body))
            response = await conn.read_response()
    assert response.version == "HTTP/1.1"
    assert response.chunks, "no chunks"
    chunks = assert_sse_response(response)
    s = summarize(chunks)
    assert len(s.ids) == 1
    assert next(iter(s.ids)).startswith("chatcmpl-")
    assert s.objects == {"chat.completion.chunk"}
    assert s.roles == {0: "assistant", 1: "assistant"}
    assert {i: len(ids) for i, ids in s.token_ids.items()} == {0: 6, 1: 6}
    assert s.finish == {0: "length", 1: "length"}
    assert s.usage is not None
    assert s.usage["completion_tokens"] == 12
    assert s.usage["total_tokens"] == s.usage["prompt_tokens"] + 12


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
async def test_non_stream_has_content_length(server: ServerProcess, path_kind: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server, path_kind) as conn:
            await conn.send(post(COMPLETIONS, {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}))
            response = await conn.read_response()
    assert response.status == 200
    assert response.framing == "length"
    assert (response.header("content-type") or "").startswith("application/json")
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 3


async def test_fresh_and_reused_connections_stream_the_same_tokens(server: ServerProcess) -> None:
    body = post(CHAT, chat_body(10, stream=True, seed=99, return_token_ids=True))
    summaries = []
    with trio.fail_after(TIMEOUT):
        for path_kind in ("fast", "models_first"):
            async with await connect(server, path_kind) as conn:
                await conn.send(body)
                summaries.append(summarize(assert_sse_response(await conn.read_response())))
    fast, reused = summaries
    assert fast.texts == reused.texts
    assert fast.token_ids == reused.token_ids
    assert fast.finish == reused.finish == {0: "length"}


# ---- keep-alive ------------------------------------------------------------------------------------


async def test_keep_alive_two_streams_on_fast_path(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            for max_tokens in (3, 5):
                await conn.send(post(CHAT, chat_body(max_tokens, stream=True, return_token_ids=True)))
                s = summarize(assert_sse_response(await conn.read_response()))
                assert len(s.token_ids[0]) == max_tokens
            # and a non-streamed one after the streams
            await conn.send(post(COMPLETIONS, {"prompt": "x", "max_tokens": 2, "ignore_eos": True}))
            response = await conn.read_response()
            assert response.status == 200
            assert response.json()["usage"]["completion_tokens"] == 2


async def test_keep_alive_models_then_stream_stays_on_the_fast_path(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server, "models_first") as conn:
            await conn.send(post(CHAT, chat_body(4, stream=True, return_token_ids=True)))
            s = summarize(assert_sse_response(await conn.read_response()))
            assert len(s.token_ids[0]) == 4
            # still the same connection: a tokenize, then another stream
            await conn.send(post("/tokenize", {"prompt": "hello world"}))
            tok = await conn.read_response()
            assert tok.status == 200
            assert tok.json()["count"] == len(tok.json()["tokens"])
            body = {"prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True}
            await conn.send(post(COMPLETIONS, body))
            s = summarize(assert_sse_response(await conn.read_response()))
            assert s.objects == {"text_completion"}
            assert s.finish == {0: "length"}


async def test_pipelined_requests(server: ServerProcess) -> None:
    """Two requests in one write: a stream, then a GET for the quart app."""
    data = post(CHAT, chat_body(3, stream=True, return_token_ids=True)) + http_request("GET", "/v1/models")
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(data)
            s = summarize(assert_sse_response(await conn.read_response()))
            models = await conn.read_response()
    assert len(s.token_ids[0]) == 3
    assert models.status == 200
    assert models.json()["data"][0]["id"] == MODEL


async def test_connection_close_header_is_honoured(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(post(CHAT, chat_body(2, stream=True), headers=[("Connection", "close")]))
            assert_sse_response(await conn.read_response())
            assert await conn.at_eof()


async def test_errors_keep_the_connection_usable(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(http_request("POST", CHAT, b"{not json"))
            assert_error_response(await conn.read_response(), 400)
            await conn.send(post(CHAT, {"messages": CHAT_MESSAGES, "model": "nope"}))
            assert_error_response(await conn.read_response(), 404)
            await conn.send(post(CHAT, chat_body(2, stream=True)))
            assert_sse_response(await conn.read_response())


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
async def test_chunked_request_body(server: ServerProcess, path: str) -> None:
    body = json.dumps(chat_body(2) if path == CHAT else {"messages": CHAT_MESSAGES}).encode()
    framed = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    headers = [("Transfer-Encoding", "chunked"), ("Content-Type", "application/json")]
    head = http_request("POST", path, headers=headers)
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(head + framed)
            response = await conn.read_response()
    assert response.status == 200, response.body
    assert ("usage" if path == CHAT else "tokens") in response.json()


# ---- HTTP/1.0 and Expect ------------------------------------------------------------------------


async def test_http10_stream_is_close_delimited(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(post(CHAT, chat_body(5, stream=True, return_token_ids=True), version="HTTP/1.0"))
            response = await conn.read_response()
    assert response.header("transfer-encoding") is None
    s = summarize(assert_sse_response(response, chunked=False))
    assert len(s.token_ids[0]) == 5


async def test_http10_non_stream(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}
            await conn.send(post(COMPLETIONS, body, version="HTTP/1.0"))
            response = await conn.read_response()
            assert response.status == 200
            assert response.json()["usage"]["completion_tokens"] == 2
            assert await conn.at_eof(), "an HTTP/1.0 connection without keep-alive must be closed"


async def test_expect_100_continue(server: ServerProcess) -> None:
    body = json.dumps(chat_body(3, stream=True, return_token_ids=True)).encode()
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(
                http_request("POST", CHAT, headers=[("Expect", "100-continue")], content_length=len(body))
            )
            interim = await conn.read_head()
            assert interim.status == 100
            await conn.send(body)
            s = summarize(assert_sse_response(await conn.read_response()))
    assert len(s.token_ids[0]) == 3


async def test_expect_100_continue_refused_when_too_large(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(
                http_request("POST", CHAT, headers=[("Expect", "100-continue")], content_length=64 << 20)
            )
            response = await conn.read_head()
            assert response.status == 413, "no 100 Continue for a body that will be refused"
            await conn.read_body(response)
    assert_error_response(response, 413)


# ---- a client that leaves mid-stream --------------------------------------------------------------


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
async def test_client_disconnect_mid_stream(slow_server: ServerProcess, path_kind: str) -> None:
    server = slow_server
    with trio.fail_after(TIMEOUT):
        conn = await connect(server, path_kind)
        # 2000 tokens at 10 ms per step: about 20 s, unless the server stops it when we leave.
        await conn.send(post(CHAT, chat_body(2000, stream=True)))
        head = await conn.read_head()
        assert head.status == 200
        events = b""
        while events.count(b"\n\n") < 3:
            chunk = await conn.read_chunk() if head.framing == "chunked" else await conn.stream.receive_some()
            assert chunk, "the stream ended early"
            events += chunk
        await conn.aclose()
        # The server is unharmed: new requests work, on both paths.
        async with await connect(server) as again:
            await again.send(post(CHAT, chat_body(3, stream=True, return_token_ids=True)))
            s = summarize(assert_sse_response(await again.read_response()))
            assert len(s.token_ids[0]) == 3
        async with await connect(server, "models_first") as again:
            await again.send(post(COMPLETIONS, {"prompt": "x", "max_tokens": 2, "ignore_eos": True}))
            assert (await again.read_response()).status == 200


async def test_client_disconnect_before_response(slow_server: ServerProcess) -> None:
    """The client sends a request and leaves at once (the server may still be rendering it)."""
    with trio.fail_after(TIMEOUT):
        for _ in range(3):
            conn = await connect(slow_server)
            await conn.send(post(CHAT, chat_body(500, stream=True)))
            await conn.aclose()
        async with await connect(slow_server) as again:
            await again.send(post(CHAT, chat_body(2)))
            response = await again.read_response()
    assert response.status == 200
    assert response.json()["usage"]["completion_tokens"] == 2


# ---- bad input ---------------------------------------------------------------------------------

BIG = 10**20  # does not fit in 64 bits
M = {"messages": CHAT_MESSAGES, "max_tokens": 2}  # a valid chat body to spoil one field of

BAD_REQUESTS: list[Any] = [
    # (id, path, raw body, expected status)
    ("malformed-json", CHAT, b'{"messages": [', 400),
    ("not-utf8", CHAT, b'{"messages": "\xff\xfe"}', 400),
    ("empty-body", CHAT, b"", 400),
    ("json-array", CHAT, b"[]", 400),
    ("json-null", CHAT, b"null", 400),
    ("messages-wrong-type", CHAT, {"messages": "hi"}, 400),
    ("missing-messages", CHAT, {"max_tokens": 3}, 400),
    ("empty-messages", CHAT, {"messages": []}, 400),
    ("message-role-not-string", CHAT, {"messages": [{"role": 1, "content": "x"}]}, 400),
    ("message-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("content-part-unsupported", CHAT, {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    ("max-tokens-string", CHAT, {"messages": CHAT_MESSAGES, "max_tokens": "ten"}, 400),
    ("max-tokens-negative", CHAT, {"messages": CHAT_MESSAGES, "max_tokens": -1}, 400),
    ("max-tokens-zero", CHAT, {"messages": CHAT_MESSAGES, "max_tokens": 0}, 400),
    ("max-tokens-float", CHAT, {"messages": CHAT_MESSAGES, "max_tokens": 1.5}, 400),
    ("max-tokens-context", CHAT, {"messages": CHAT_MESSAGES, "max_tokens": MAX_MODEL_LEN}, 400),
    ("max-tokens-absurd", CHAT, {"messages": CHAT_MESSAGES, "max_tokens": 10**30}, 400),
    ("max-completion-tokens-negative", CHAT, {"messages": CHAT_MESSAGES, "max_completion_tokens": -5}, 400),
    ("n-zero", CHAT, {**M, "n": 0}, 400),
    ("n-negative", CHAT, {**M, "n": -3}, 400),
    ("n-too-big", CHAT, {**M, "n": 17}, 400),
    ("n-absurd", CHAT, {**M, "n": BIG}, 400),
    ("temperature-high", CHAT, {**M, "temperature": 9}, 400),
    ("temperature-inf", CHAT, {**M, "temperature": 1e400}, 400),
    ("top-p-zero", CHAT, {**M, "top_p": 0}, 400),
    ("top-k-negative", CHAT, {**M, "top_k": -2}, 400),
    ("seed-too-big", CHAT, {**M, "seed": BIG}, 400),
    ("min-tokens-over-max", CHAT, {**M, "min_tokens": 5}, 400),
    ("stop-wrong-type", CHAT, {**M, "stop": 5}, 400),
    ("too-many-stops", CHAT, {**M, "stop": list("abcdefghijklmnopq")}, 400),
    ("stop-token-ids-negative", CHAT, {**M, "stop_token_ids": [-1]}, 400),
    ("stop-token-ids-too-many", CHAT, {**M, "stop_token_ids": list(range(129))}, 400),
    pytest.param("stop-token-ids-huge", CHAT, {**M, "stop_token_ids": [BIG]}, 400),
    pytest.param("top-k-huge", CHAT, {**M, "top_k": BIG}, 400),
    pytest.param("priority-huge", COMPLETIONS, {"prompt": "x", "priority": BIG}, 400),
    ("stream-options-without-stream", CHAT, {"messages": CHAT_MESSAGES, "stream_options": {}}, 400),
    ("stream-not-bool", CHAT, {"messages": CHAT_MESSAGES, "stream": "yes"}, 400),
    ("top-logprobs-without-logprobs", CHAT, {**M, "top_logprobs": 2}, 400),
    ("top-logprobs-over-max", CHAT, {**M, "logprobs": True, "top_logprobs": 21}, 400),
    ("tools", CHAT, {"messages": CHAT_MESSAGES, "tools": [{"type": "function"}]}, 400),
    ("unknown-model", CHAT, {"messages": CHAT_MESSAGES, "model": "nope"}, 404),
    ("prompt-missing", COMPLETIONS, {"max_tokens": 2}, 400),
    ("prompt-empty", COMPLETIONS, {"prompt": "", "max_tokens": 2}, 400),
    ("prompt-empty-list", COMPLETIONS, {"prompt": [], "max_tokens": 2}, 400),
    ("prompt-empty-nested", COMPLETIONS, {"prompt": [[]], "max_tokens": 2}, 400),
    ("prompt-batched-mixed", COMPLETIONS, {"prompt": ["a", [1, 2]], "max_tokens": 2}, 400),
    ("prompt-mixed", COMPLETIONS, {"prompt": [1, "a"], "max_tokens": 2}, 400),
    ("prompt-bad-token-id", COMPLETIONS, {"prompt": [-1], "max_tokens": 2}, 400),
    ("prompt-huge-token-id", COMPLETIONS, {"prompt": [BIG], "max_tokens": 2}, 400),
    ("prompt-object", COMPLETIONS, {"prompt": {"text": "x"}, "max_tokens": 2}, 400),
    ("prompt-too-long", COMPLETIONS, {"prompt": "hello " * (MAX_MODEL_LEN + 10), "max_tokens": 2}, 400),
    ("prompt-ids-too-long", COMPLETIONS, {"prompt": [100] * MAX_MODEL_LEN, "max_tokens": 2}, 400),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}, 400),
    ("prompt-logprobs-streamed", COMPLETIONS, {"prompt": "x", "stream": True, "prompt_logprobs": 1}, 400),
]


def _raw(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _bad_cases() -> list[Any]:
    """Every bad request as sent, and again with ``"stream": true`` where the body is an object that
    can carry it (errors are refused before streaming starts, so the answer is the same JSON)."""
    cases = []
    for case in BAD_REQUESTS:
        values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
        name, path, body, status = values
        cases.append(pytest.param(path, _raw(body), status, id=name, marks=marks))
        if isinstance(body, dict) and "stream" not in body and "stream_options" not in body:
            streamed = _raw({**body, "stream": True})
            cases.append(pytest.param(path, streamed, status, id=f"{name}-stream", marks=marks))
    return cases


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
@pytest.mark.parametrize(("path", "body", "status"), _bad_cases())
async def test_bad_request(
    server: ServerProcess, path: str, body: bytes, status: int, path_kind: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server, path_kind) as conn:
            await conn.send(http_request("POST", path, body))
            response = await conn.read_response()
            error = assert_error_response(response, status)
            if status == 404:
                assert error["param"] == "model"
            # The connection survives a refused request.
            await conn.send(post(COMPLETIONS, {"prompt": "ok", "max_tokens": 1}))
            assert (await conn.read_response()).status == 200


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
async def test_oversized_body_is_413(server: ServerProcess, path_kind: str) -> None:
    """Announced past --max-request-body-bytes (4 MiB): refused without reading the body."""
    with trio.fail_after(TIMEOUT):
        async with await connect(server, path_kind) as conn:
            await conn.send(http_request("POST", CHAT, content_length=5 * 1024 * 1024))
            response = await conn.read_response()
    assert_error_response(response, 413)


async def test_oversized_tokenize_body_is_413(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(http_request("POST", "/tokenize", content_length=5 * 1024 * 1024))
            response = await conn.read_response()
    assert_error_response(response, 413)


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/no-such-route", None, 404),
        ("GET", CHAT, None, 405),
        ("DELETE", "/v1/models", None, 405),
        ("POST", "/tokenize", b"{", 400),
        ("POST", "/tokenize", b"{}", 400),
        ("POST", "/tokenize", b'{"prompt": 5}', 400),
        ("POST", "/tokenize", b'{"prompt": "x", "model": "nope"}', 404),
        ("POST", "/detokenize", b'{"tokens": [-1]}', 400),
        ("POST", "/detokenize", b'{"tokens": ["a"]}', 400),
        ("POST", "/detokenize", b'{"tokens": [10000000]}', 400),
    ],
)
async def test_other_routes_errors(
    server: ServerProcess, method: str, path: str, body: bytes | None, status: int
) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(http_request(method, path, body))
            response = await conn.read_response()
    assert_error_response(response, status)


async def test_health_and_tokenize_roundtrip(server: ServerProcess) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server) as conn:
            await conn.send(http_request("GET", "/health"))
            assert (await conn.read_response()).status == 200
            await conn.send(post("/tokenize", {"prompt": "Hello, trio!"}))
            tokens = (await conn.read_response()).json()["tokens"]
            await conn.send(post("/detokenize", {"tokens": tokens}))
            assert (await conn.read_response()).json() == {"prompt": "Hello, trio!"}


# ---- curl -N ---------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not on PATH")
async def test_curl_no_buffer(server: ServerProcess) -> None:
    usage = {"include_usage": True}
    body = json.dumps(chat_body(5, stream=True, return_token_ids=True, stream_options=usage))
    command = [
        "curl", "-N", "-sS", "--fail-with-body", "--max-time", "30",
        "-H", "Content-Type: application/json", "-d", body, f"{server.url}{CHAT}",
    ]  # fmt: skip
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    payloads = parse_sse(result.stdout)
    assert payloads[-1] == "[DONE]"
    s = summarize([json.loads(p) for p in payloads[:-1]])
    assert len(s.token_ids[0]) == 5
    assert s.usage is not None
    assert s.usage["completion_tokens"] == 5


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {**M, "store": True}, "store"),
        (CHAT, {**M, "min_p": 2}, "min_p"),
        (CHAT, {**M, "foo": 1}, "foo"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "stop": ["x" * 1025]}, "stop"),
    ],
    ids=["unsupported", "out-of-range", "unknown", "no-content", "logprobs-over-max", "stop-too-long"],
)
async def test_refusals_name_the_parameter(
    server: ServerProcess, path: str, body: dict[str, Any], param: str, path_kind: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with await connect(server, path_kind) as conn:
            await conn.send(post(path, body))
            error = assert_error_response(await conn.read_response(), 400)
    assert error["param"] == param


@pytest.mark.parametrize("path_kind", ["fast", "models_first"])
@pytest.mark.parametrize("where", ["chat_template_kwargs", "content-part"])
async def test_deep_nesting_is_a_400_not_a_500(server: ServerProcess, where: str, path_kind: str) -> None:
    deep = b"[" * 20_000 + b"]" * 20_000
    if where == "chat_template_kwargs":
        body = b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":%b}}' % deep
    else:
        body = b'{"messages":[{"role":"user","content":[{"type":"text","text":"x","z":%b}]}]}' % deep
    with trio.fail_after(TIMEOUT):
        async with await connect(server, path_kind) as conn:
            await conn.send(http_request("POST", CHAT, body))
            assert_error_response(await conn.read_response(), 400)
            await conn.send(post(COMPLETIONS, {"prompt": "ok", "max_tokens": 1}))
            assert (await conn.read_response()).status == 200
