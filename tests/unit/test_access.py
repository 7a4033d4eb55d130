"""The edge's pure decisions (API key, CORS, X-Request-Id), the access-log line, the token buckets and
process metrics, and the command line that configures them."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import msgspec
import pytest

from trioserve.cli import build_parser, main, serve_config
from trioserve.config import AccessConfig, ServeConfig
from trioserve.frontend.access_log import AccessRecord, format_line
from trioserve.frontend.edge.access import MAX_REQUEST_ID, Gate, client_request_id
from trioserve.frontend.edge.auth import ApiKeys
from trioserve.frontend.edge.cors import CorsPolicy
from trioserve.metrics import one_two_five, process_metrics

# ---- X-Request-Id ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        (b"abc-123", "abc-123"),
        (b"Root=1-5759e988;x", None),  # ";" is not in the set
        (b"a" * MAX_REQUEST_ID, "a" * MAX_REQUEST_ID),
        (b"a" * (MAX_REQUEST_ID + 1), None),
        (b"", None),
        (None, None),
        (b"trace:a/b+c=d~e_f.g", "trace:a/b+c=d~e_f.g"),
        (b'a"b', None),  # would need escaping in JSON
        (b"a\\b", None),
        (b"\xc3\xa9", None),
        (b"a b", None),
    ],
)
def test_request_id_rules(value: bytes | None, accepted: str | None) -> None:
    assert client_request_id(value) == accepted


# ---- API keys -------------------------------------------------------------------------------------


def test_api_key_routes_and_tokens() -> None:
    keys = ApiKeys(["k1", "k2"])
    assert not keys.protects(b"/health") and not keys.protects(b"/metrics")
    for path in (b"/v1/models", b"/tokenize", b"/detokenize", b"/v1/ws", b"/anything", b"/health/", b"/"):
        assert keys.protects(path), path
    assert ApiKeys(["k"], all_routes=True).protects(b"/health")
    assert not ApiKeys([]).protects(b"/v1/models")
    assert keys.refusal(b"Bearer k1") is None
    assert keys.refusal(b"BEARER   k2") is None
    for bad in (None, b"", b"Bearer", b"Basic k1", b"k1", b"Bearer k3", b"Bearer k1k1", b"Bearer k"):
        assert keys.refusal(bad) is not None, bad


def test_api_key_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key is compared, with ``hmac.compare_digest``, over equal-length digests, whether the
    token matches the first key, the last or none, and whatever its length."""
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = ApiKeys(["first", "second-key", "third"])
    for token in (b"first", b"third", b"nope", b"x" * 1000):
        calls.clear()
        keys.refusal(b"Bearer " + token)
        assert calls == [(32, 32)] * 3


# ---- CORS -----------------------------------------------------------------------------------------


def test_cors_rules() -> None:
    default = CorsPolicy(["*"], ["*"], ["*"])
    assert default.response_headers(None) == []
    assert default.response_headers(b"https://a") == [(b"access-control-allow-origin", b"*")]
    status, headers, refused = default.preflight(b"https://a", b"patch", None)
    assert (status, refused) == (204, None)
    h = dict(headers)
    assert h[b"access-control-allow-origin"] == b"*"
    assert h[b"access-control-allow-methods"] == b"DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
    assert b"access-control-allow-headers" not in h and b"vary" not in h

    # "*" with credentials: the origin is echoed (a browser refuses "*" with credentials), so the
    # answer varies by origin, and the requested headers are named, not "*".
    creds = CorsPolicy(["*"], ["*"], ["*"], credentials=True, expose=["X-Request-Id"])
    assert creds.response_headers(b"https://a") == [
        (b"access-control-allow-origin", b"https://a"),
        (b"vary", b"origin"),
        (b"access-control-allow-credentials", b"true"),
        (b"access-control-expose-headers", b"X-Request-Id"),
    ]
    assert creds.response_headers(None) == [(b"vary", b"origin")]
    _, headers, _ = creds.preflight(b"https://a", b"POST", b"Authorization, X-Custom")
    h = dict(headers)
    assert h[b"access-control-allow-origin"] == b"https://a"
    assert h[b"access-control-allow-headers"] == b"authorization, x-custom"
    assert h[b"vary"] == b"origin, access-control-request-headers"
    assert h[b"access-control-allow-credentials"] == b"true"

    strict = CorsPolicy(["https://a"], ["post"], ["X-Api"])
    assert strict.response_headers(b"https://b") == [(b"vary", b"origin")]
    assert strict.preflight(b"https://a", b"POST", b"x-api, content-type")[0] == 204
    assert (
        strict.preflight(b"https://a", b"POST", b"x-other")[2]
        == "CORS preflight refused: headers not allowed"
    )
    status, headers, refused = strict.preflight(b"https://b", b"GET", None)
    assert status == 400 and refused == "CORS preflight refused: origin, method not allowed"
    assert headers == [(b"vary", b"origin")]  # no Allow-Origin: the browser stops there


def test_gate_order_preflight_then_key_then_route() -> None:
    gate = Gate(AccessConfig(api_key=("k",)))
    preflight = [(b"origin", b"https://a"), (b"access-control-request-method", b"POST")]
    verdict = gate.check(b"OPTIONS", b"/v1/chat/completions", preflight)
    assert verdict.reply is not None and verdict.reply.status == 204
    verdict = gate.check(b"POST", b"/v1/chat/completions", [(b"origin", b"https://a")])
    assert verdict.reply is not None and verdict.reply.status == 401
    assert (b"access-control-allow-origin", b"*") in verdict.reply.headers
    body = msgspec.json.decode(verdict.reply.body)
    assert body["error"]["code"] == "invalid_api_key"
    verdict = gate.check(
        b"POST", b"/v1/chat/completions", [(b"authorization", b"Bearer k"), (b"x-request-id", b"r")]
    )
    assert verdict.reply is None and verdict.request_id == "r"
    # Only the first Authorization header counts.
    two = [(b"authorization", b"Bearer nope"), (b"authorization", b"Bearer k")]
    assert gate.check(b"GET", b"/v1/models", two).reply is not None


# ---- the access log, buckets, process metrics -----------------------------------------------------


def test_access_line() -> None:
    record = AccessRecord(
        ("10.0.0.1", 5000), "POST", "/v1/completions", "1.1", 200, 0.4027, 12, 40, 0.0312, "r-1"
    )
    assert format_line(record) == (
        '10.0.0.1:5000 "POST /v1/completions HTTP/1.1" 200 prompt_tokens=12 output_tokens=40 '
        "ttft_ms=31.2 duration_ms=402.7 request_id=r-1"
    )
    bare = AccessRecord(None, "GET", "/health", "1.0", 503, 0.001)
    assert format_line(bare) == (
        '- "GET /health HTTP/1.0" 503 prompt_tokens=- output_tokens=- ttft_ms=- duration_ms=1.0 request_id=-'
    )


def test_token_buckets() -> None:
    assert one_two_five(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert one_two_five(1000)[-1] == 1000
    assert one_two_five(1) == (1,)


def test_process_metrics_read_proc(tmp_path: Path) -> None:
    import os

    (tmp_path / "self" / "fd").mkdir(parents=True)
    for i in range(5):
        (tmp_path / "self" / "fd" / str(i)).touch()
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    # pid (comm with a space and a paren) state, then fields 4..24 of proc(5).
    rest = ["S"] + ["0"] * 10 + [str(3 * tick), str(tick)] + ["0"] * 6 + [str(50 * tick), "4096000", "250"]
    (tmp_path / "self" / "stat").write_text("1234 (a b) c) " + " ".join(rest) + " 0 0\n")
    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1700000000\n")
    values = {name: value for name, _, _, value in process_metrics(str(tmp_path))}
    assert values["process_cpu_seconds_total"] == 4.0
    assert values["process_start_time_seconds"] == 1700000050.0
    assert values["process_virtual_memory_bytes"] == 4096000
    assert values["process_resident_memory_bytes"] == 250 * page
    assert values["process_open_fds"] == 5
    assert process_metrics(str(tmp_path / "missing")) == []


# ---- the command line -----------------------------------------------------------------------------


def test_access_flags_reach_the_config() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "--api-key",
            "a",
            "b",
            "--api-key-all-routes",
            "--allowed-origins",
            '["https://x.example"]',
            "--allowed-methods",
            '["GET", "POST"]',
            "--allow-credentials",
            "--enable-request-id-headers",
            "--disable-uvicorn-access-log",  # vLLM's name for --disable-access-log
            "--disable-access-log-for-endpoints",
            "/health,/metrics",
        ]
    )
    access = serve_config(ns).frontend.access
    assert access == AccessConfig(
        api_key=("a", "b"),
        api_key_all_routes=True,
        allowed_origins=("https://x.example",),
        allowed_methods=("GET", "POST"),
        allow_credentials=True,
        enable_request_id_headers=True,
        disable_access_log=True,
        disable_access_log_for_endpoints="/health,/metrics",
    )


def test_api_key_from_the_environment() -> None:
    parser = build_parser()
    env = {"TRIOSERVE_API_KEY": "from-env"}
    assert serve_config(parser.parse_args(["serve"]), env).frontend.access.api_key == ("from-env",)
    # The flag wins; an empty variable is no key.
    flagged = serve_config(parser.parse_args(["serve", "--api-key", "flag"]), env)
    assert flagged.frontend.access.api_key == ("flag",)
    assert serve_config(parser.parse_args(["serve"]), {"TRIOSERVE_API_KEY": ""}) == ServeConfig()
    # The key never reaches the engine core's part of the tree (its command line).
    assert (
        "from-env"
        not in msgspec.json.encode(
            serve_config(parser.parse_args(["serve"]), env).engine_process("ipc:///x")
        ).decode()
    )


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["serve", "--allowed-origins", "*"], "argument --allowed-origins: expected a JSON list"),
        (["serve", "--allowed-headers", '{"a": 1}'], "argument --allowed-headers: expected a JSON list"),
        (["serve", "--api-key", ""], "api_key: an API key must not be empty"),
    ],
)
def test_bad_access_flags(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert names in err and err.count("\n") == 1


def test_access_log_is_skipped_below_info(caplog: pytest.LogCaptureFixture) -> None:
    from trioserve.frontend.access_log import AccessLog

    log = AccessLog("/health")
    caplog.set_level(logging.WARNING, logger="trioserve.access")
    assert not log.wanted(b"/v1/models")
    caplog.set_level(logging.INFO, logger="trioserve.access")
    assert log.wanted(b"/v1/models") and not log.wanted(b"/health")
