"""``stream_options.continuous_usage_stats`` (vLLM's, which its benchmark client and guidellm send):
every streamed chunk carries the usage so far."""

from __future__ import annotations

from trio.testing import MockClock

from tests.trio.conftest import Stack
from tests.trio.test_streaming import CHAT, chat_body


async def test_every_chunk_carries_the_usage_so_far(stack: Stack, autojump_clock: MockClock) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    reply = await (await stack.client()).request(CHAT, chat_body(20, stream_options=options))
    assert reply.status == 200
    chunks = reply.chunks
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert prompt > 0
    seen = 0
    for chunk in chunks[:-1]:  # the role chunk, then content chunks
        seen += len(chunk["choices"][0].get("token_ids") or [])
        usage = chunk["usage"]
        assert usage == {"prompt_tokens": prompt, "completion_tokens": seen, "total_tokens": prompt + seen}
    assert seen == 20
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


async def test_without_it_only_the_final_chunk_has_usage(stack: Stack, autojump_clock: MockClock) -> None:
    reply = await (await stack.client()).request(CHAT, chat_body(5, stream_options={"include_usage": True}))
    assert [("usage" in c) for c in reply.chunks] == [False] * (len(reply.chunks) - 1) + [True]


async def test_it_needs_include_usage(stack: Stack, autojump_clock: MockClock) -> None:
    body = chat_body(5, stream_options={"continuous_usage_stats": True})
    reply = await (await stack.client()).request(CHAT, body)
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "stream_options.continuous_usage_stats"
