"""Serving a deployment, on the MockClock stack: the API key on every protected route (fast path, ASGI
routes, WebSocket upgrade), CORS with its preflight on both paths, X-Request-Id, the access log,
/version, /ping, /load, /v1/models/{id}, and the metrics vLLM dashboards read."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import h11
import msgspec
import pytest
import trio
import trio.testing
from trio.testing import MockClock
from wsproto.events import AcceptConnection, Request

from tests.trio.conftest import BASE_CONFIG, Stack, start_stack
from tests.trio.http_client import HttpClient, Reply
from tests.trio.test_streaming import CHAT, chat_body
from tests.trio.test_websocket_fast_path import WsClient
from trioserve.config import ServeConfig, override
from trioserve.frontend.text.tokenizer import Tokenizer

COMPLETIONS = "/v1/completions"
KEY = "sk-test-key"
OTHER_KEY = "second-key"
BEARER = [("authorization", f"Bearer {KEY}")]
KEYED = override(BASE_CONFIG, api_key=(KEY, OTHER_KEY))


@asynccontextmanager
async def running(tokenizer: Tokenizer, config: ServeConfig = BASE_CONFIG) -> AsyncIterator[Stack]:
    with trio.fail_after(60):  # virtual seconds: a hang fails fast
        async with trio.open_nursery() as nursery:
            yield await start_stack(nursery, tokenizer, config)
            # The last response's bytes may be out before its access-log line is written.
            await trio.sleep(1)
            nursery.cancel_scope.cancel()


async def call(
    client: HttpClient,
    method: str,
    path: str,
    body: Any = b"",
    headers: Sequence[tuple[str, str | bytes]] = (),
) -> Reply:
    """One request with the given headers on ``client``'s connection (kept alive when h11 allows)."""
    payload = body if isinstance(body, bytes) else msgspec.json.encode(body)
    given = [("host", "test"), ("content-length", str(len(payload))), *headers]
    if payload:
        given.append(("content-type", "application/json"))
    fields = [(k.encode(), v if isinstance(v, bytes) else v.encode()) for k, v in given]
    conn = client.conn
    data = conn.send(h11.Request(method=method, target=path, headers=fields)) or b""
    if payload:
        data += conn.send(h11.Data(data=payload)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    await client.sock.send(data)
    reply = await client.read_body(await client.read_head())
    if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
        conn.start_next_cycle()
    return reply


def completion_body(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, **extra}


# Every protected route, with what it answers once the key is right.
PROTECTED: list[tuple[str, str, Any, int]] = [
    ("POST", CHAT, chat_body(3), 200),  # fast path, streamed
    ("POST", COMPLETIONS, completion_body(3), 200),  # fast path, one JSON body
    ("GET", "/v1/models", b"", 200),  # ASGI
    ("GET", "/v1/models/trioserve-mock", b"", 200),
    ("POST", "/tokenize", {"prompt": "hello"}, 200),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}, 200),
    ("GET", "/v1/no-such-route", b"", 404),  # fail closed: unknown paths need the key too
    ("GET", "/%68ealth", b"", 200),  # an encoded spelling of an open route needs the key too
]


def assert_unauthorized(reply: Reply) -> None:
    assert reply.status == 401, (reply.status, reply.body)
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key"
    assert error["param"] is None
    assert KEY not in error["message"]
    assert reply.headers[b"www-authenticate"] == b"Bearer"


async def test_api_key_on_every_protected_route(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with running(tokenizer, KEYED) as stack:
        client = await stack.client()  # one keep-alive connection: a 401 leaves it usable
        for method, path, body, ok in PROTECTED:
            for headers in (
                [],
                [("authorization", "Bearer wrong")],
                [("authorization", f"Bearer {KEY}x")],  # a longer key is not the key
                [("authorization", f"Basic {KEY}")],
                [("authorization", "Bearer")],
            ):
                assert_unauthorized(await call(client, method, path, body, headers))
            assert (await call(client, method, path, body, BEARER)).status == ok, path
            other = [("authorization", f"bearer  {OTHER_KEY}")]  # the scheme in any case; any key
            assert (await call(client, method, path, body, other)).status == ok, path
        missing = (await call(client, "POST", CHAT, chat_body(2))).json()["error"]["message"]
        wrong = (await call(client, "POST", CHAT, chat_body(2), [("authorization", "Bearer x")])).json()
        assert "no API key" in missing and wrong["error"]["message"] == "invalid API key"
        # Nothing refused reached the engine or holds a slot.
        assert stack.api.serving.admission.in_flight == 0


async def test_open_routes_need_no_key_unless_all_routes(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    routes = [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/load"), ("GET", "/version")]
    routes.append(("GET", "/metrics"))
    async with running(tokenizer, KEYED) as stack:
        client = await stack.client()
        for method, path in routes:
            assert (await call(client, method, path)).status == 200, path
    async with running(tokenizer, override(KEYED, api_key_all_routes=True)) as stack:
        client = await stack.client()
        for method, path in routes:
            assert_unauthorized(await call(client, method, path))
            assert (await call(client, method, path, headers=BEARER)).status == 200, path


async def test_no_key_configured_checks_nothing(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with running(tokenizer) as stack:
        client = await stack.client()
        reply = await call(client, "POST", CHAT, chat_body(2), [("authorization", "Bearer anything")])
        assert reply.status == 200
        assert b"www-authenticate" not in reply.headers


async def test_websocket_upgrade_needs_the_key(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    upgrade = [
        ("connection", "Upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ]
    async with running(tokenizer, KEYED) as stack:
        client = await stack.client()
        assert_unauthorized(await call(client, "GET", "/v1/ws", headers=upgrade))
        # The refused upgrade was answered like any request: the connection goes on.
        assert (await call(client, "GET", "/health")).status == 200
        # With the key, the same upgrade is accepted, and requests run on the socket.
        ws = WsClient(client.sock)  # a fresh connection would do as well; this one is idle
        await ws.sock.send(
            ws.ws.send(
                Request(
                    host="test", target="/v1/ws", extra_headers=[(b"authorization", f"Bearer {KEY}".encode())]
                )
            )
        )
        assert isinstance(await ws.next_event(), AcceptConnection)
        await ws.request("a", chat_body(3))
        assert (await ws.until_final("a"))["type"] == "done"


# ---- CORS -----------------------------------------------------------------------------------------


def preflight(
    origin: str, method: str = "POST", headers: str | None = "content-type, authorization"
) -> list[tuple[str, str]]:
    out = [("origin", origin), ("access-control-request-method", method)]
    if headers is not None:
        out.append(("access-control-request-headers", headers))
    return out


async def test_cors_defaults_allow_every_origin_on_both_paths(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    async with running(tokenizer, KEYED) as stack:
        client = await stack.client()
        for path in (CHAT, COMPLETIONS, "/v1/models", "/tokenize", "/v1/ws"):
            # A preflight needs no key (a browser sends none on it) and is answered before routing.
            reply = await call(client, "OPTIONS", path, headers=preflight("https://app.example"))
            assert reply.status == 204, (path, reply.body)
            h = reply.headers
            assert h[b"access-control-allow-origin"] == b"*"
            assert b"POST" in h[b"access-control-allow-methods"]
            assert h[b"access-control-allow-headers"] == b"content-type, authorization"  # echoed
            assert h[b"access-control-max-age"] == b"600"
            assert b"access-control-allow-credentials" not in h
        origin = [("origin", "https://app.example"), *BEARER]
        for method, path, body, ok in PROTECTED[:5]:
            reply = await call(client, method, path, body, origin)
            assert reply.status == ok
            assert reply.headers[b"access-control-allow-origin"] == b"*", path
            assert b"vary" not in reply.headers  # the answer is the same for every origin
        # Without Origin a request is not a CORS request; without the request method, OPTIONS is
        # not a preflight and goes to its route (405 on the generation routes, as before).
        plain = await call(client, "POST", CHAT, chat_body(2), BEARER)
        assert b"access-control-allow-origin" not in plain.headers
        assert (await call(client, "OPTIONS", CHAT, headers=BEARER)).status == 405
        # A refused request still tells the page why.
        refused = await call(client, "POST", CHAT, chat_body(2), [("origin", "https://app.example")])
        assert refused.status == 401 and refused.headers[b"access-control-allow-origin"] == b"*"
        bad = await call(client, "POST", CHAT, {"messages": []}, origin)
        assert bad.status == 400 and bad.headers[b"access-control-allow-origin"] == b"*"


async def test_cors_explicit_origins_with_credentials(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    config = override(
        BASE_CONFIG,
        allowed_origins=("https://app.example",),
        allowed_methods=("POST", "GET"),
        allowed_headers=("Authorization", "X-Request-Id"),
        allow_credentials=True,
    )
    good, evil = "https://app.example", "https://evil.example"
    async with running(tokenizer, config) as stack:
        client = await stack.client()
        for path in (CHAT, "/v1/models"):
            reply = await call(client, "OPTIONS", path, headers=preflight(good, headers="authorization"))
            assert reply.status == 204
            h = reply.headers
            assert h[b"access-control-allow-origin"] == good.encode()
            assert h[b"access-control-allow-methods"] == b"POST, GET"
            allowed = h[b"access-control-allow-headers"].split(b", ")
            assert {b"authorization", b"x-request-id", b"content-type"} <= set(allowed)
            assert h[b"access-control-allow-credentials"] == b"true"
            assert h[b"vary"] == b"origin"
            for refused, headers in (
                ("origin", preflight(evil)),
                ("method", preflight(good, method="DELETE")),
                ("headers", preflight(good, headers="x-secret")),
            ):
                no = await call(client, "OPTIONS", path, headers=headers)
                assert no.status == 400 and refused in no.json()["error"]["message"]
                assert b"access-control-allow-origin" not in no.headers
        for method, path, body, _ in PROTECTED[:3]:
            yes = await call(client, method, path, body, [("origin", good)])
            assert yes.headers[b"access-control-allow-origin"] == good.encode()
            assert yes.headers[b"access-control-allow-credentials"] == b"true"
            assert yes.headers[b"vary"] == b"origin"
            # Another origin is served (CORS is not access control) but told nothing; caches are
            # told the answer depends on the origin, with it or without one.
            for headers in ([("origin", evil)], []):
                other = await call(client, method, path, body, headers)
                assert other.status == 200
                assert b"access-control-allow-origin" not in other.headers
                assert other.headers[b"vary"] == b"origin"


# ---- X-Request-Id -----------------------------------------------------------------------------------


async def test_request_id_is_echoed_and_used(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    config = override(BASE_CONFIG, enable_request_id_headers=True)
    async with running(tokenizer, config) as stack:
        client = await stack.client()
        given = [("x-request-id", "trace-42:a/b")]
        first = await call(client, "POST", CHAT, chat_body(3), given)
        second = await call(client, "POST", CHAT, chat_body(3), given)
        ids = []
        for reply in (first, second):
            assert reply.headers[b"x-request-id"] == b"trace-42:a/b"
            chunk_ids = {chunk["id"] for chunk in reply.chunks}
            assert len(chunk_ids) == 1
            ids.append(chunk_ids.pop())
        # The client's id leads, and the server's unique part follows: the same header twice still
        # gives two responses (and so two sets of engine requests, "<id>-<choice>") of their own.
        assert all(i.startswith("chatcmpl-trace-42:a/b-") for i in ids) and ids[0] != ids[1]
        full = await call(client, "POST", COMPLETIONS, completion_body(2), given)
        assert full.json()["id"].startswith("cmpl-trace-42:a/b-")
        # Without one (or with one that is too long, or has unsafe characters: ignored), the header
        # carries the id the server made, which is the response's.
        for headers in (
            [],
            [("x-request-id", "x" * 129)],
            [("x-request-id", "a b")],
            [("x-request-id", "é".encode())],
        ):
            reply = await call(client, "POST", CHAT, chat_body(2), headers)
            made = reply.headers[b"x-request-id"].decode()
            assert reply.chunks[0]["id"] == f"chatcmpl-{made}"
        refused = await call(client, "POST", CHAT, {"messages": []}, given)
        assert refused.status == 400 and refused.headers[b"x-request-id"] == b"trace-42:a/b"
        # The ASGI routes echo it too, and browsers may read it.
        models = await call(client, "GET", "/v1/models", headers=[*given, ("origin", "https://a.example")])
        assert models.headers[b"x-request-id"] == b"trace-42:a/b"
        assert models.headers[b"access-control-expose-headers"] == b"X-Request-Id"
        assert (await call(client, "GET", "/health")).headers[b"x-request-id"]
    async with running(tokenizer, override(KEYED, enable_request_id_headers=True)) as stack:
        client = await stack.client()  # the edge's own answers echo it too
        for method, headers, status in (
            ("POST", [], 401),
            ("OPTIONS", preflight("https://a.example"), 204),
            ("GET", BEARER, 405),
        ):
            reply = await call(client, method, CHAT, headers=[*headers, ("x-request-id", "e-1")])
            assert (reply.status, reply.headers[b"x-request-id"]) == (status, b"e-1")
    async with running(tokenizer) as stack:  # echo off (the default): still used in the id
        client = await stack.client()
        reply = await call(client, "POST", CHAT, chat_body(2), [("x-request-id", "mine")])
        assert b"x-request-id" not in reply.headers
        assert reply.chunks[0]["id"].startswith("chatcmpl-mine-")


# ---- the access log ---------------------------------------------------------------------------------

LINE = re.compile(
    r'^(?P<client>\S+) "(?P<method>\S+) (?P<target>\S+) HTTP/1\.1" (?P<status>\d+) '
    r"prompt_tokens=(?P<prompt>\S+) output_tokens=(?P<output>\S+) ttft_ms=(?P<ttft>\S+) "
    r"duration_ms=(?P<duration>\S+) request_id=(?P<rid>\S+)$"
)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    out = []
    for record in caplog.records:
        if record.name == "trioserve.access":
            match = LINE.match(record.getMessage())
            assert match is not None, record.getMessage()
            out.append(match.groupdict())
    return out


async def test_access_log_one_line_per_request(
    tokenizer: Tokenizer, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with running(tokenizer, KEYED) as stack:
        client = await stack.client()
        streamed = await call(client, "POST", CHAT, chat_body(5), [*BEARER, ("x-request-id", "r1")])
        full = await call(client, "POST", COMPLETIONS, completion_body(4), BEARER)
        await call(client, "GET", "/health?probe=1")
        await call(client, "GET", "/v1/models")  # 401
        await call(client, "POST", CHAT, {"messages": []}, BEARER)  # 400
        await call(client, "OPTIONS", CHAT, headers=preflight("https://a.example"))
    lines = access_lines(caplog)
    assert [(ln["method"], ln["target"], ln["status"]) for ln in lines] == [
        ("POST", CHAT, "200"),
        ("POST", COMPLETIONS, "200"),
        ("GET", "/health?probe=1", "200"),
        ("GET", "/v1/models", "401"),
        ("POST", CHAT, "400"),
        ("OPTIONS", CHAT, "204"),
    ]
    usage = streamed.chunks[-1]  # include_usage is off: count the tokens the events carried
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in streamed.chunks) == 5 and usage
    chat, completion, health = lines[0], lines[1], lines[2]
    prompt = len(tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}], True, None))
    assert (chat["prompt"], chat["output"]) == (str(prompt), "5")
    assert (completion["prompt"], completion["output"]) == (str(full.json()["usage"]["prompt_tokens"]), "4")
    for line in (chat, completion):
        assert float(line["ttft"]) >= 0 and float(line["duration"]) >= float(line["ttft"])
    assert chat["rid"] == streamed.chunks[0]["id"].removeprefix("chatcmpl-")
    assert chat["rid"].startswith("r1-")
    assert completion["rid"] == full.json()["id"].removeprefix("cmpl-")
    assert (health["prompt"], health["output"], health["ttft"], health["rid"]) == ("-", "-", "-", "-")
    assert lines[4]["prompt"] == "-" and lines[4]["rid"] != "-"  # refused before any token


async def test_access_log_off_or_filtered(
    tokenizer: Tokenizer, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with running(tokenizer, override(BASE_CONFIG, disable_access_log=True)) as stack:
        client = await stack.client()
        await call(client, "POST", CHAT, chat_body(2))
        await call(client, "GET", "/health")
    assert access_lines(caplog) == []
    filtered = override(BASE_CONFIG, disable_access_log_for_endpoints="/health, /metrics")
    async with running(tokenizer, filtered) as stack:
        client = await stack.client()
        for path in ("/health", "/metrics", "/version"):
            await call(client, "GET", path)
    assert [ln["target"] for ln in access_lines(caplog)] == ["/version"]


async def test_access_log_for_a_client_that_leaves(
    tokenizer: Tokenizer, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Written once, when the request ends, with what it produced: never per token."""
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with running(tokenizer) as stack:
        client = await stack.client()
        await client.send_request(CHAT, chat_body(400))
        reply = await client.read_body(await client.read_head(), max_events=4)
        assert access_lines(caplog) == []  # tokens are flowing: nothing logged yet
        client.close()
        await stack.api.serving.drained()  # the server saw the client leave
        await trio.sleep(0.01)
    (line,) = access_lines(caplog)
    assert line["status"] == "200" and 3 <= int(line["output"]) < 400 and len(reply.events) == 4


# ---- routes -----------------------------------------------------------------------------------------


async def test_version_ping_load_and_model_routes(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    import importlib.metadata

    config = override(BASE_CONFIG, served_model_name=("org/model", "alias"))
    async with running(tokenizer, config) as stack:
        client = await stack.client()
        version = await call(client, "GET", "/version")
        assert version.json() == {"version": importlib.metadata.version("trioserve")}
        for method in ("GET", "POST"):
            assert (await call(client, method, "/ping")).status == 200
        assert (await call(client, "GET", "/load")).json() == {"server_load": 0}
        card = (await call(client, "GET", "/v1/models/org/model")).json()
        assert (card["id"], card["object"], card["max_model_len"]) == ("org/model", "model", 512)
        assert (await call(client, "GET", "/v1/models/alias")).json()["id"] == "alias"
        missing = await call(client, "GET", "/v1/models/nope")
        assert missing.status == 404
        error = missing.json()["error"]
        assert error["param"] == "model" and "nope" in error["message"]
        # /load counts what this server holds: one running stream.
        other = await stack.client()
        await other.send_request(CHAT, {**chat_body(400), "model": "alias"})
        await other.read_body(await other.read_head(), max_events=2)
        assert (await call(client, "GET", "/load")).json() == {"server_load": 1}
        stack.api.serving.draining = True  # /ping is /health: 503 while draining
        assert (await call(client, "GET", "/ping")).status == 503


# ---- metrics ----------------------------------------------------------------------------------------


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = r"^" + re.escape(name) + r"(\{[^}]*" + re.escape(labels) + r"[^}]*\})? (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, f"{name} {labels} not in /metrics"
    return float(match.group(2))


async def test_metrics_dashboards_use(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with running(tokenizer) as stack:
        client = await stack.client()
        first = await call(client, "POST", COMPLETIONS, completion_body(6, stream=False))
        second = await call(client, "POST", COMPLETIONS, completion_body(3, n=2, stream=False))
        prompt = first.json()["usage"]["prompt_tokens"]
        assert second.json()["usage"]["prompt_tokens"] == prompt
        # A third that is cut short: its client leaves mid-stream.
        third = await stack.client()
        await third.send_request(COMPLETIONS, completion_body(400, stream=True))
        await third.read_body(await third.read_head(), max_events=3)
        third.close()
        await stack.api.serving.drained()  # the server saw the client leave
        generated = stack.api.metrics.generation_tokens
        text = (await call(client, "GET", "/metrics")).body.decode()
    assert sample(text, "vllm:request_prompt_tokens_count") == 3  # one per request, whatever n
    assert sample(text, "vllm:request_prompt_tokens_sum") == 3 * prompt
    assert sample(text, "vllm:request_generation_tokens_sum") == generated
    cut = generated - 6 - 2 * 3  # what the third made before its client left
    for le in (5, 10, 500):
        expected = sum(tokens <= le for tokens in (6, 6, cut))
        assert sample(text, "vllm:request_generation_tokens_bucket", f'le="{le}"') == expected
    assert 'vllm:request_generation_tokens_bucket{model_name="trioserve-mock",le="500"}' in text  # up to 512
    assert 'le="1000"' not in text.split("vllm:request_generation_tokens_bucket", 1)[1].split("# HELP")[0]
    # Per finished request (the one cut short is not): 6 tokens and 2 x 3 tokens.
    assert sample(text, "vllm:request_time_per_output_token_seconds_count") == 2
    # The old name is the inter-token latency itself.
    assert sample(text, "vllm:time_per_output_token_seconds_count") == sample(
        text, "vllm:inter_token_latency_seconds_count"
    )
    # Per engine step: every token generated, plus each choice's prompt once, at its first token.
    assert sample(text, "vllm:iteration_tokens_total_sum") == generated + 4 * prompt
    assert sample(text, "vllm:iteration_tokens_total_count") >= 6  # the first request took 6 steps
    assert sample(text, "process_cpu_seconds_total") > 0
    assert sample(text, "process_resident_memory_bytes") > 0
    assert 3 <= sample(text, "process_open_fds") <= sample(text, "process_max_fds")
    assert 0 < sample(text, "process_start_time_seconds") <= time.time()
    assert "# TYPE process_cpu_seconds_total counter" in text


async def test_access_log_for_requests_refused_at_the_edge(
    tokenizer: Tokenizer, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with running(tokenizer, override(BASE_CONFIG, max_request_body_bytes=100)) as stack:
        client = await stack.client()
        assert (await call(client, "POST", CHAT, b"x" * 200)).status == 413
        client = await stack.client()
        await trio.testing.wait_all_tasks_blocked()  # its handler waits for the first head
        stack.api.http.draining = True  # (as drain does, but without closing idle connections)
        await client.send_request("/v1/models", b"", method="GET")
        assert (await client.read_head()).status == 503
    assert [(ln["target"], ln["status"]) for ln in access_lines(caplog)] == [
        (CHAT, "413"),
        ("/v1/models", "503"),
    ]
