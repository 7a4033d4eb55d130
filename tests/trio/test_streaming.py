"""API server + mock engine in one Trio run on a MockClock: streaming semantics, exactly.

Every test names ``autojump_clock``: pytest-trio takes the clock from the test's own arguments.
"""

from __future__ import annotations

import itertools

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import STEP_US, Stack
from trioserve.frontend.edge.http_server import HEAD_TIMEOUT
from trioserve.mock.core import MockCore

STEP = STEP_US / 1e6
CHAT = "/v1/chat/completions"


def chat_body(max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
        **extra,
    }


async def test_stream_one_token_per_event_per_step_and_exact_usage(
    stack: Stack, autojump_clock: MockClock
) -> None:
    client = await stack.client()
    body = chat_body(12, stream_options={"include_usage": True})
    reply = await client.request(CHAT, body)
    assert reply.status == 200
    assert reply.events[-1].data == "[DONE]"
    content = [e for e in reply.events if e.data != "[DONE]" and e.data["choices"]]
    role, tokens = content[0], content[1:]
    assert role.data["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [len(e.data["choices"][0]["token_ids"]) for e in tokens] == [1] * 12
    # One engine step per token on the step clock: events are exactly one step apart.
    gaps = [b.time - a.time for a, b in itertools.pairwise(tokens)]
    assert gaps == pytest.approx([STEP] * 11)
    assert tokens[-1].data["choices"][0]["finish_reason"] == "length"
    prompt_ids = stack.api.serving.tokenizer.apply_chat_template(body["messages"], True, None)  # type: ignore[arg-type]
    usage = reply.events[-2].data["usage"]
    assert usage == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
    }
    # Nothing is left behind on either side.
    assert not stack.api.serving.active and not stack.api.handler.choices
    assert not stack.engine.core.running


async def test_streamed_text_equals_detokenized_ids(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    reply = await client.request(CHAT, chat_body(40, seed=7))
    ids = [t for c in reply.content_events() for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in reply.chunks)
    assert len(ids) == 40
    assert text == stack.api.serving.tokenizer.decode(ids)


async def test_stop_string_aborts_engine_within_one_step(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    # Learn the seeded token stream, then stop on a string that appears mid-way.
    first = await client.request(CHAT, chat_body(30, seed=3))
    pieces = [c["choices"][0]["delta"]["content"] for c in first.content_events()]
    k = next(i for i in range(10, 30) if pieces[i].strip())  # a token with visible text
    stop = pieces[k].strip()
    expected = "".join(pieces)[: "".join(pieces).index(stop)]

    aborted_at: dict[str, int] = {}

    class RecordingCore(MockCore):
        def abort(self, request_ids: list[str]) -> None:
            for rid in request_ids:
                if rid in self.running:
                    aborted_at[rid] = self.running[rid].num_output
            super().abort(request_ids)

    old = stack.engine.core
    core = stack.engine.core = RecordingCore(
        old.vocab_size,
        old.max_num_seqs,
        old.max_model_len,
        step_interval_us=old.step_interval_us,
        current_time=old.current_time,
        sleep_until=old.sleep_until,
    )
    reply = await client.request(CHAT, chat_body(30, seed=3, stop=[stop]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in reply.chunks)
    assert text == expected
    assert reply.content_events()[-1]["choices"][0]["finish_reason"] == "stop"
    assert reply.content_events()[-1]["choices"][0]["stop_reason"] == stop
    # The engine had made the matching token (index <= k) and at most one step more.
    await trio.sleep(STEP)
    (made,) = aborted_at.values()
    matched_at = len(reply.content_events())
    assert matched_at <= k + 1
    assert made <= matched_at + 1
    assert not core.running


async def test_client_disconnect_aborts_engine_request(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    await client.send_request(CHAT, chat_body(10_000 // 40))
    reply = await client.read_body(await client.read_head(), max_events=5)
    assert len(reply.events) == 5
    assert len(stack.engine.core.running) == 1
    client.close()
    await trio.sleep(2 * STEP)
    assert not stack.engine.core.running
    assert not stack.api.serving.active and not stack.api.handler.choices


async def test_parallel_choices_usage_is_exact(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    body = chat_body(9, n=3)
    body["stream"] = False
    reply = await client.request(CHAT, body)
    assert reply.status == 200
    data = reply.json()
    assert sorted(c["index"] for c in data["choices"]) == [0, 1, 2]
    assert all(len(c["token_ids"]) == 9 for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 27
    assert data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])


async def test_slow_reader_gets_merged_events_and_every_token(
    stack: Stack, autojump_clock: MockClock
) -> None:
    # Tiny socket buffers: a client that stops reading backs the sink up within a few events.
    client = await stack.client(rcvbuf=4096)
    await client.send_request(CHAT, chat_body(200))
    head = await client.read_head()
    reply = await client.read_body(head, max_events=3)
    await trio.sleep(100 * STEP)  # stop reading for 100 engine steps
    await client.read_body(reply)
    per_event = [len(c["choices"][0]["token_ids"]) for c in reply.content_events()]
    assert sum(per_event) == 200
    assert max(per_event) > 1  # merged while backlogged, instead of an unbounded queue
    assert reply.events[-1].data == "[DONE]"


async def test_engine_death_ends_streams_with_an_error_event(stack: Stack, autojump_clock: MockClock) -> None:
    client = await stack.client()
    await client.send_request(CHAT, chat_body(400))
    head = await client.read_head()
    assert head.status == 200
    reply = await client.read_body(head, max_events=3)
    stack.api.serving.on_engine_dead("test: engine gone")
    await client.read_body(reply)
    assert reply.events[-1].data == "[DONE]"
    assert reply.events[-2].data["error"]["code"] == 503
    again = await (await stack.client()).request(CHAT, chat_body(5))
    assert again.status == 503
    assert again.json()["error"]["type"] == "ServiceUnavailableError"


async def test_engine_refusal_before_the_first_token_is_an_http_error(
    stack: Stack, autojump_clock: MockClock
) -> None:
    # The API server admits prompts up to its own max_model_len; an engine with a smaller window
    # refuses them with an error output, which must become an HTTP 400, not a 200 stream.
    stack.engine.core.max_model_len = 8
    reply = await (await stack.client()).request(CHAT, chat_body(5))
    assert reply.status == 400
    assert "max_model_len" in reply.json()["error"]["message"]
    assert not stack.api.serving.active and not stack.api.handler.choices


async def test_idle_connections_are_closed_after_the_keep_alive_timeout(
    stack: Stack, autojump_clock: MockClock
) -> None:
    idle = await stack.client()
    served = await stack.client()
    assert (await served.request(CHAT, chat_body(2))).status == 200
    await trio.sleep(HEAD_TIMEOUT + 1)
    assert await idle.sock.recv(1) == b""  # the server closed it: no request ever came
    assert await served.sock.recv(1) == b""  # idle after its request: closed as well
