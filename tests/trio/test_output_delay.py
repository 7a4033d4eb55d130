"""The default that refuses at the door on its own (``--max-output-delay-ms``), on a MockClock.

The API server is made to run out of CPU deterministically: its output handler takes COST of
(virtual) time per running request for each step it processes, so it keeps up with CAPACITY streams
and falls further behind the more it holds beyond that, as a saturated event loop does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.output.output_handler import StampedStepQueue
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.protocol.messages import EngineOutputs, EngineStats

STEP = STEP_US / 1e6
CAPACITY = 8
COST = STEP / CAPACITY  # handler time per running request per step
TOKENS = 60  # per request: 0.6 s of engine time each


@dataclass
class Outcome:
    sent: float
    status: int
    retry_after: bytes | None
    answered_in: float  # send -> response head
    ttft: float | None  # send -> first token
    tokens: int


@dataclass
class Run:
    stack: Stack
    outcomes: list[Outcome]  # in arrival order
    metrics: str  # /metrics once every client is done
    after: int  # the status of one more request once the load is over


async def run_load(tokenizer: Tokenizer, clients: int, spacing: float, **config: Any) -> Run:
    """``clients`` streaming requests of TOKENS tokens, one every ``spacing`` seconds, against a
    handler with CAPACITY."""
    outcomes: list[Outcome | None] = [None] * clients
    metrics, after = "", 0
    async with trio.open_nursery() as nursery:
        # A deep output queue, so that a handler that falls behind shows as steps waiting (the
        # default queue of 2 folds them instead, which bounds the wait and hides it from the gate).
        config = {"output_queue_size": 64, **config}
        stack = await start_stack(nursery, tokenizer, override(BASE_CONFIG, **config))
        queue, handler = stack.api.steps, stack.api.handler
        fast_get = queue.get

        async def slow_get() -> EngineOutputs:
            await trio.sleep(COST * len(handler.choices))
            return await fast_get()

        queue.get = slow_get  # type: ignore[method-assign]

        async def one(i: int) -> None:
            client = await stack.client()
            sent = trio.current_time()
            await client.send_request(CHAT, chat_body(TOKENS))
            head = await client.read_head()
            answered = trio.current_time() - sent
            reply = await client.read_body(head)
            content = [e for e in reply.events if e.data != "[DONE]" and e.data["choices"]]
            tokens = sum(len(e.data["choices"][0].get("token_ids") or ()) for e in content)
            first = next((e.time for e in content if e.data["choices"][0].get("token_ids")), None)
            outcomes[i] = Outcome(
                sent,
                head.status,
                head.headers.get(b"retry-after"),
                answered,
                None if first is None else first - sent,
                tokens,
            )

        async with trio.open_nursery() as clients_nursery:
            for i in range(clients):
                clients_nursery.start_soon(one, i)
                await trio.sleep(spacing)
        client = await stack.client()
        metrics = (await client.request("/metrics", b"", method="GET")).body.decode()
        after = (await client.request(CHAT, chat_body(3))).status
        nursery.cancel_scope.cancel()
    return Run(stack, [o for o in outcomes if o is not None], metrics, after)


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\} (\S+)", text)
    assert match is not None, f"{name} {labels} not in /metrics"
    return float(match.group(1))


async def test_normal_load_is_never_shed(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    # CAPACITY - 2 streams at a time (a new one every 0.1 s, each lasting 0.6 s): the handler keeps up.
    run = await run_load(tokenizer, clients=30, spacing=0.1)
    outcomes, metrics = run.outcomes, run.metrics
    assert [o.status for o in outcomes] == [200] * 30
    assert all(o.tokens == TOKENS for o in outcomes)
    assert max(o.ttft or 1.0 for o in outcomes) <= 2 * STEP
    admission = run.stack.api.serving.admission
    assert admission.output_delay.shut_count == 0 and not admission.rejected
    assert sample(metrics, "trioserve:output_delay_shedding") == 0
    assert sample(metrics, "trioserve:output_delay_seconds_bucket", 'le="0.01"') == sample(
        metrics, "trioserve:output_delay_seconds_count"
    )


async def test_overload_is_refused_at_once_with_503_and_admitted_requests_keep_their_ttft(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    # A new request every step, 0.6 s each: ~60 streams wanted, CAPACITY carried.
    run = await run_load(tokenizer, clients=120, spacing=STEP)
    outcomes, metrics = run.outcomes, run.metrics
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status != 200]
    assert refused and admitted
    for o in refused:
        assert (o.status, o.retry_after, o.answered_in, o.tokens) == (503, b"1", 0.0, 0)
    # Every admitted request completes, whole; none hangs, none is cut off.
    assert all(o.tokens == TOKENS for o in admitted)
    # The first CAPACITY arrive before the overload: their first token one step after arrival.
    assert [o.status for o in outcomes[:CAPACITY]] == [200] * CAPACITY
    assert max(o.ttft or 1.0 for o in outcomes[:CAPACITY]) <= 2 * STEP
    # The gate acts on delay that has appeared: the requests admitted while it grew wait up to about
    # the budget for their first token, plus what it grew meanwhile; never the seconds it grows to
    # without the gate (below).
    budget = BASE_CONFIG.frontend.admission.max_output_delay_ms / 1e3
    assert max(o.ttft or 10.0 for o in admitted) < 2 * budget
    admission = run.stack.api.serving.admission
    assert admission.rejected == {"output_delay": len(refused)}
    assert admission.in_flight == 0
    assert run.after == 200  # once the backlog is gone the gate opens again
    assert sample(metrics, "trioserve:rejected_requests_total", 'reason="output_delay"') == len(refused)
    assert sample(metrics, "trioserve:output_delay_shedding_episodes_total") >= 1


async def test_without_the_gate_the_same_overload_grows_ttft(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    run = await run_load(tokenizer, clients=120, spacing=STEP, max_output_delay_ms=0.0)
    assert all(o.status == 200 and o.tokens == TOKENS for o in run.outcomes)
    assert max(o.ttft or 0.0 for o in run.outcomes) > 1.0  # the silently growing TTFT


def engine_step(i: int) -> EngineOutputs:
    return EngineOutputs(0, i, 0.0, [], EngineStats(0, 0))


async def test_delay_estimate_follows_the_backlog(autojump_clock: MockClock) -> None:
    queue = StampedStepQueue(3, "coalesce")
    assert queue.delay_estimate(trio.current_time()) == 0.0
    for i in range(5):  # three queued, the last two folded into the third (which keeps its stamp)
        await queue.put(engine_step(i))
        await trio.sleep(STEP)
    assert queue.depth == 3
    assert queue.delay_estimate(trio.current_time()) == pytest.approx(5 * STEP)  # the oldest's wait
    # The handler takes them back to back, 4 steps' time each: its time per step is learned ...
    taken = [await queue.get()]
    for _ in range(2):
        await trio.sleep(4 * STEP)
        taken.append(await queue.get())
    assert [s.step for s in taken] == [0, 1, 4] and queue.last_wait == pytest.approx(11 * STEP)
    assert queue.service_time == pytest.approx(3 * STEP)  # 0 -> 2 -> 3 steps (moving average)
    # ... and predicts the wait of a backlog before anything in it has waited long.
    for i in range(5, 8):
        await queue.put(engine_step(i))
    assert queue.delay_estimate(trio.current_time()) == pytest.approx(3 * 3 * STEP)
    # Once the handler keeps up again (it waits for steps, taking 1 ms each), the estimate follows.
    for _ in range(3):
        await queue.get()
    for i in range(8, 20):
        await trio.sleep(0.001)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.get)
            await trio.sleep(STEP)
            await queue.put(engine_step(i))
    assert queue.service_time < 0.002
    assert queue.delay_estimate(trio.current_time()) == 0.0
