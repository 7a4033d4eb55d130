"""Each policy of the engine -> API server hops, shown on a MockClock with a saturated API server.

The API server is made slow deterministically: its output handler takes three engine steps of
(virtual) time per step it processes, as a loop that is out of CPU would.
"""

from __future__ import annotations

from typing import Any

import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.protocol.messages import EngineOutputs

STEP = STEP_US / 1e6
TOKENS = 120


async def run_slow(tokenizer: Tokenizer, **config: Any) -> tuple[Stack, list[int], int, float]:
    """One streamed request of TOKENS tokens against a slow output handler. Returns the stack, the
    tokens per event the client saw, the engine's steps, and the time from first to last token."""
    cfg = override(BASE_CONFIG, **{"output_queue_size": 4, "engine_output_hwm": 2, **config})
    result: tuple[Stack, list[int], int, float] | None = None
    async with trio.open_nursery() as nursery:
        stack = await start_stack(nursery, tokenizer, cfg)
        queue = stack.api.steps
        fast_get = queue.get

        async def slow_get() -> EngineOutputs:
            await trio.sleep(3 * STEP)
            return await fast_get()

        queue.get = slow_get  # type: ignore[method-assign]
        reply = await (await stack.client()).request(CHAT, chat_body(TOKENS))
        per_event = [len(c["choices"][0]["token_ids"]) for c in reply.content_events()]
        # From the first token on: rendering runs on a real thread, during which the autojumping
        # clock may move by any amount.
        first = next(e.time for e in reply.events if e.data != "[DONE]" and e.data["choices"])
        result = (stack, per_event, stack.engine.step_count, reply.events[-1].time - first)
        nursery.cancel_scope.cancel()
    assert result is not None
    return result


async def test_defaults_coalesce_and_fold_the_engine_never_stalls(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    stack, per_event, steps, _ = await run_slow(tokenizer)
    assert sum(per_event) == TOKENS  # nothing lost
    assert max(per_event) > 1  # the backlog shows as several tokens per event ...
    assert stack.api.steps.max_depth <= 4  # ... not as a growing queue
    assert stack.api.steps.coalesced > 0
    assert steps == TOKENS  # the engine made one step per token, on its clock, without waiting


async def test_block_everywhere_stalls_the_engine(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    stack, per_event, _, elapsed = await run_slow(
        tokenizer, output_queue_policy="block", engine_output_policy="block"
    )
    assert sum(per_event) == TOKENS and max(per_event) == 1  # nothing merged: one token per event
    assert stack.api.steps.max_depth <= 4
    # The engine could only step as fast as the slow handler drained: ~3 step times per step.
    assert elapsed > 2.5 * TOKENS * STEP
    assert stack.engine.pump.folded_steps == 0


async def test_block_in_the_server_fold_in_the_engine(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    stack, per_event, _, elapsed = await run_slow(tokenizer, output_queue_policy="block")
    assert sum(per_event) == TOKENS
    assert stack.engine.pump.folded_steps > 0  # the engine folded steps the socket would not take
    assert stack.api.steps.coalesced == 0
    assert elapsed < 2.5 * TOKENS * STEP  # and kept stepping: the stream finishes far sooner


async def test_unbounded_grows_without_limit(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    stack, per_event, _, _ = await run_slow(tokenizer, output_queue_policy="unbounded", engine_output_hwm=0)
    assert sum(per_event) == TOKENS
    assert stack.api.steps.max_depth > 4 * 10  # vLLM's shape: the backlog is a queue in memory
