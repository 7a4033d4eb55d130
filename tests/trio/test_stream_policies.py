"""Stream policies (output handler -> each request) on a MockClock, with one client that stops
reading for a while (tiny socket buffers make it back up within a few events)."""

from __future__ import annotations

import itertools

import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, start_stack
from tests.trio.http_client import Reply
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.text.tokenizer import Tokenizer

STEP = STEP_US / 1e6
TOKENS = 200
PAUSE = 60 * STEP  # how long the slow client stops reading


async def slow_and_fast(tokenizer: Tokenizer, policy: str, **config: int) -> tuple[Reply, Reply, int]:
    """Runs a slow and a fast streaming client side by side; returns both replies and how many
    requests the engine still runs right after the slow client resumed."""
    cfg = override(BASE_CONFIG, stream_policy=policy, **config)
    async with trio.open_nursery() as nursery:
        stack = await start_stack(nursery, tokenizer, cfg)
        slow, fast = await stack.client(rcvbuf=4096), await stack.client()
        await slow.send_request(CHAT, chat_body(TOKENS))
        await fast.send_request(CHAT, chat_body(TOKENS))
        slow_reply = await slow.read_body(await slow.read_head(), max_events=3)
        fast_reply: Reply | None = None
        fast_done = trio.Event()

        async def read_fast() -> None:
            nonlocal fast_reply
            fast_reply = await fast.read_body(await fast.read_head())
            fast_done.set()

        nursery.start_soon(read_fast)
        await trio.sleep(PAUSE)
        running = len(stack.engine.core.running)
        await slow.read_body(slow_reply)
        await fast_done.wait()
        nursery.cancel_scope.cancel()
    assert fast_reply is not None
    return slow_reply, fast_reply, running


def tokens_per_event(reply: Reply) -> list[int]:
    return [len(c["choices"][0]["token_ids"]) for c in reply.content_events()]


def gaps(reply: Reply) -> list[float]:
    times = [e.time for e in reply.events if e.data != "[DONE]" and e.data["choices"]][1:]
    return [b - a for a, b in itertools.pairwise(times)]


async def test_merge_slow_client_gets_merged_chunks_fast_one_is_untouched(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    slow, fast, _ = await slow_and_fast(tokenizer, "merge")
    assert sum(tokens_per_event(slow)) == TOKENS and max(tokens_per_event(slow)) > 1
    assert tokens_per_event(fast) == [1] * TOKENS
    assert max(gaps(fast)) < 1.5 * STEP


async def test_queue_n_queues_chunks_before_merging(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    slow, _, _ = await slow_and_fast(tokenizer, f"queue:{TOKENS}")
    assert tokens_per_event(slow) == [1] * TOKENS  # N was never reached: every chunk queued as is
    slow8, _, _ = await slow_and_fast(tokenizer, "queue:8")
    assert sum(tokens_per_event(slow8)) == TOKENS and max(tokens_per_event(slow8)) > 1


async def test_abort_slow_client_cuts_off_only_the_slow_client(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    slow, fast, running = await slow_and_fast(tokenizer, "abort-slow-client", slow_client_max_tokens=16)
    assert running == 1  # the slow client's engine request was aborted while it was not reading
    assert slow.events[-1].data == "[DONE]"
    error = slow.events[-2].data["error"]
    assert error["code"] == 503 and "too slow" in error["message"]
    assert sum(tokens_per_event(slow)) < TOKENS
    assert tokens_per_event(fast) == [1] * TOKENS  # everyone else keeps one token per event
    assert max(gaps(fast)) < 1.5 * STEP


async def test_stall_makes_every_stream_wait_for_the_slowest(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    slow, fast, _ = await slow_and_fast(tokenizer, "stall")
    assert sum(tokens_per_event(slow)) == TOKENS and sum(tokens_per_event(fast)) == TOKENS
    assert max(gaps(fast)) > PAUSE / 2  # the fast client waited while the slow one did not read
