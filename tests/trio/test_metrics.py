"""/metrics after known traffic: exact counts, vLLM names, and trioserve's own saturation metrics."""

from __future__ import annotations

import re

from trio.testing import MockClock

from tests.trio.conftest import Stack
from tests.trio.test_streaming import CHAT, chat_body


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\} (\S+)"
    match = re.search(pattern, text)
    assert match is not None, f"{name} {labels} not in /metrics"
    return float(match.group(1))


async def test_metrics_count_exactly_what_was_served(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    assert (await client.request(CHAT, chat_body(12))).status == 200
    body = chat_body(5, n=2)
    body["stream"] = False
    assert (await client.request(CHAT, body)).status == 200
    assert (await client.request(CHAT, chat_body(10_000))).status == 400

    reply = await (await stack.client()).request("/metrics", b"", method="GET")
    assert reply.status == 200
    text = reply.body.decode()
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert sample(text, "vllm:time_to_first_token_seconds_count") == 3  # one per choice
    assert sample(text, "vllm:e2e_request_latency_seconds_count") == 3
    assert sample(text, "vllm:inter_token_latency_seconds_count") == 11 + 2 * 4
    assert sample(text, "vllm:generation_tokens_total") == 22
    assert sample(text, "vllm:request_success_total", 'finished_reason="length"') == 3
    assert sample(text, "trioserve:stream_events_total") == 12  # one token per event
    assert sample(text, "trioserve:stream_tokens_total") == 12
    assert sample(text, "trioserve:requests_in_flight") == 0
    assert sample(text, "vllm:num_requests_running") == 0
    assert sample(text, "vllm:time_to_first_token_seconds_bucket", 'le="+Inf"') == 3
