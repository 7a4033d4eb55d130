"""/metrics after known traffic: exact counts, vLLM names, and trioserve's own saturation metrics."""

from __future__ import annotations

import re

import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.text.tokenizer import Tokenizer

STEP = STEP_US / 1e6


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
    assert sample(text, "trioserve:renderer_jobs_total") == 0  # rendered on the event loop here


async def test_metrics_show_queue_high_water_mark_and_renderer_batching(tokenizer: Tokenizer) -> None:
    """On the real clock: the renderer's thread would let an autojumping clock run off."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            stack = await start_stack(nursery, tokenizer, override(BASE_CONFIG, renderer_num_workers=1))
            client = await stack.client()
            for _ in range(2):  # one after the other: each render is a batch of its own
                assert (await client.request(CHAT, chat_body(3))).status == 200
            text = (await client.request("/metrics", b"", method="GET")).body.decode()
            assert "# TYPE trioserve:renderer_batches_total counter" in text
            assert sample(text, "trioserve:renderer_jobs_total") == 2
            assert sample(text, "trioserve:renderer_batches_total") == 2
            assert "# HELP trioserve:output_queue_depth_max " in text
            assert sample(text, "trioserve:output_queue_depth_max") == stack.api.steps.max_depth >= 1
            nursery.cancel_scope.cancel()


async def test_metrics_show_what_waits_for_slow_clients(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    for policy in ("merge", "stall"):
        cfg = override(BASE_CONFIG, stream_policy=policy)
        async with trio.open_nursery() as nursery:
            stack = await start_stack(nursery, tokenizer, cfg)
            slow, fast = await stack.client(rcvbuf=4096), await stack.client()
            await slow.send_request(CHAT, chat_body(200))
            reply = await slow.read_body(await slow.read_head(), max_events=3)
            await trio.sleep(60 * STEP)  # the slow client stops reading; its socket fills up
            text = (await fast.request("/metrics", b"", method="GET")).body.decode()
            assert sample(text, "trioserve:streams_backlogged") == 1
            backlog = sample(text, "trioserve:stream_backlog_bytes")
            assert backlog > 0 and sample(text, "trioserve:stream_backlog_bytes_max") == backlog
            if policy == "merge":
                assert sample(text, "trioserve:streams_merging") == 1
                merged = sample(text, "trioserve:stream_merged_tokens")
                assert merged > 0 and sample(text, "trioserve:stream_merged_tokens_max") == merged
                assert sample(text, "trioserve:streams_stalled") == 0
            else:  # the handler waits for the slow client instead of merging
                assert sample(text, "trioserve:streams_stalled") == 1
            await slow.read_body(reply)
            text = (await fast.request("/metrics", b"", method="GET")).body.decode()
            for name in ("streams_backlogged", "streams_merging", "streams_stalled", "stream_backlog_bytes"):
                assert sample(text, f"trioserve:{name}") == 0
            nursery.cancel_scope.cancel()
