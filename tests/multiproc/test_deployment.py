"""A real server with an API key (given in ``TRIOSERVE_API_KEY``), against the unmodified ``openai``
SDK: a wrong or missing key raises ``AuthenticationError`` on every route the SDK uses, the right one
works, the open routes stay open, the key never reaches the engine's command line, and each request
leaves one access-log line."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trio

from ._own_server import Server
from ._support import CHAT_MESSAGES, RawHttp, proc_children

KEY = "sk-deploy-test-0123456789"


@pytest.fixture
def keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    monkeypatch.setenv("TRIOSERVE_API_KEY", KEY)  # the server inherits it: no flag on its command line
    server = Server(tmp_path / "keyed.log", "--enable-request-id-headers", "--served-model-name", "m")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def sdk(server: Server, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)


async def test_sdk_raises_authentication_error_for_a_wrong_key(keyed: Server) -> None:
    wrong = sdk(keyed, "sk-wrong")
    try:
        with pytest.raises(openai.AuthenticationError) as exc:
            await wrong.chat.completions.create(model="m", messages=CHAT_MESSAGES, max_tokens=3)
        assert exc.value.status_code == 401
        assert exc.value.code == "invalid_api_key"
        assert KEY not in str(exc.value)
        with pytest.raises(openai.AuthenticationError):
            await wrong.completions.create(model="m", prompt="hi", max_tokens=3, stream=True)
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.retrieve("m")
    finally:
        await wrong.close()

    right = sdk(keyed, KEY)
    try:
        raw = await right.chat.completions.with_raw_response.create(
            model="m",
            messages=CHAT_MESSAGES,
            max_tokens=4,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "sdk-call-1"},
        )
        assert raw.headers["x-request-id"] == "sdk-call-1"
        response = raw.parse()
        assert response.usage is not None and response.usage.completion_tokens == 4
        assert response.id.startswith("chatcmpl-sdk-call-1-")
        stream = await right.completions.create(
            model="m", prompt="hi", max_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
        assert len([chunk async for chunk in stream]) == 5
        assert [m.id for m in (await right.models.list()).data] == ["m"]
        assert (await right.models.retrieve("m")).id == "m"
        with pytest.raises(openai.NotFoundError):
            await right.models.retrieve("nope")
    finally:
        await right.close()

    # Open without a key: the probes and the scraper.
    for path in ("/health", "/ping", "/load", "/version", "/metrics"):
        async with await RawHttp.connect("127.0.0.1", keyed.port) as conn:
            await conn.send(f"GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n".encode())
            assert (await conn.read_response()).status == 200, path

    # The key is in the API server's environment only: the engine core's command line lacks it.
    (engine,) = proc_children(keyed.proc.pid)
    assert KEY.encode() not in cmdline(engine) and KEY.encode() not in cmdline(keyed.proc.pid)

    await trio.sleep(0.2)  # the last line is written just after its response
    log = keyed.log()
    assert KEY not in log
    lines = re.findall(r'"(\S+) (\S+) HTTP/1\.1" (\d+) prompt_tokens=(\S+) output_tokens=(\S+)', log)
    assert ("POST", "/v1/chat/completions", "401", "-", "-") in lines
    assert any(ln[:3] == ("POST", "/v1/chat/completions", "200") and ln[4] == "4" for ln in lines)
    assert any(ln[:3] == ("POST", "/v1/completions", "200") and ln[4] == "5" for ln in lines)
    assert ("GET", "/v1/models/nope", "404", "-", "-") in lines
