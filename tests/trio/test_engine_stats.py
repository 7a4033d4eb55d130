"""Engine stats never freeze (issue 10 item 6), on a MockClock, for the mock engine and the engine core.

An engine reports its stats right after the step in which its last request finished or was aborted,
and sends a heartbeat every ``HEARTBEAT_INTERVAL`` while idle; admission ignores stats older than
``STATS_MAX_AGE``. The reproduction: small admission caps, every client disconnects at once, and then
every new request was refused with 503 "N requests are waiting in the engine", forever.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.http_client import HttpClient
from tests.trio.test_engine_core import start_core_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.frontend.request.admission import STATS_MAX_AGE
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineOutputs

STEP = STEP_US / 1e6
MAX_NUM_SEQS = 4  # the engine runs 4 at a time ...
MAX_WAITING = 2  # ... and the API server refuses new requests once 2 wait in the engine


def sample(text: str, name: str) -> float:
    match = re.search(re.escape(name) + r"\{[^}]*\} (\S+)", text)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


@asynccontextmanager
async def mock_stack(tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    config = override(BASE_CONFIG, max_num_seqs=MAX_NUM_SEQS, max_num_seqs_waiting=MAX_WAITING)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            yield await start_stack(nursery, tokenizer, config)
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def core_stack(tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            stack = await start_core_stack(nursery, tokenizer, num_blocks=1024)
            # The same caps as the mock's: 4 running at a time, refuse at 2 waiting.
            stack.core.scheduler.config = replace(stack.core.scheduler.config, max_num_seqs=MAX_NUM_SEQS)
            admission = stack.api.serving.admission
            admission.limits = override(admission.limits, max_num_seqs_waiting=MAX_WAITING)
            yield stack
            nursery.cancel_scope.cancel()


async def metrics(stack: Stack) -> str:
    return (await (await stack.client()).request("/metrics", b"", method="GET")).body.decode()


async def start_streams(stack: Stack, n: int) -> list[HttpClient]:
    clients = []
    for _ in range(n):
        client = await stack.client()
        await client.send_request(CHAT, chat_body(400))
        clients.append(client)
    for client in clients[:MAX_NUM_SEQS]:  # the others wait in the engine: nothing is written yet
        head = await client.read_head()
        assert head.status == 200
        await client.read_body(head, max_events=2)
    return clients


@pytest.mark.parametrize("engine", ["mock", "core"])
async def test_a_disconnect_storm_does_not_lock_the_server_out(
    tokenizer: Tokenizer, autojump_clock: MockClock, engine: str
) -> None:
    opened = mock_stack(tokenizer) if engine == "mock" else core_stack(tokenizer)
    async with opened as stack:
        clients = await start_streams(stack, 2 * MAX_NUM_SEQS)  # 4 running, 4 waiting
        await trio.sleep(3 * STEP)
        text = await metrics(stack)
        assert sample(text, "vllm:num_requests_running") == MAX_NUM_SEQS
        assert sample(text, "vllm:num_requests_waiting") == MAX_NUM_SEQS
        refused = await (await stack.client()).request(CHAT, chat_body(5))
        assert refused.status == 503
        assert "waiting in the engine" in refused.json()["error"]["message"]

        for client in clients:  # everyone leaves at once
            client.close()
        await trio.sleep(2 * STEP)
        text = await metrics(stack)
        assert sample(text, "vllm:num_requests_running") == 0
        assert sample(text, "vllm:num_requests_waiting") == 0
        # Nothing runs in the engine now, and a new request is admitted and served.
        assert sample(text, "trioserve:requests_in_flight") == 0
        admitted = await (await stack.client()).request(CHAT, chat_body(5))
        assert admitted.status == 200
        assert len(admitted.content_events()) == 5


def record_engine_messages(stack: Stack) -> list[tuple[float, EngineOutputs]]:
    """Every engine message the API server's output handler takes from now on, with its time."""
    handler = stack.api.handler
    seen: list[tuple[float, EngineOutputs]] = []
    process = handler.process

    def recording(step: EngineOutputs) -> None:
        seen.append((trio.current_time(), step))
        process(step)

    handler.process = recording  # type: ignore[method-assign]
    return seen


async def test_the_last_request_finishing_reports_idle_stats_at_once(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    async with mock_stack(tokenizer) as stack:
        seen = record_engine_messages(stack)
        client = await stack.client()
        await client.send_request(CHAT, chat_body(400))
        await client.read_body(await client.read_head(), max_events=3)
        client.close()
        closed = trio.current_time()
        await trio.sleep(2 * STEP)
        after = [step for t, step in seen if t >= closed]
        # At most the step that was running when the client left, then one stats-only idle report
        # that says the engine is empty.
        assert [len(step.outputs) for step in after] in ([0], [1, 0])
        assert after[-1].stats.num_running == after[-1].stats.num_waiting == 0


@pytest.mark.parametrize("engine", ["mock", "core"])
async def test_an_idle_engine_sends_a_heartbeat_every_interval(
    tokenizer: Tokenizer, autojump_clock: MockClock, engine: str
) -> None:
    opened = mock_stack(tokenizer) if engine == "mock" else core_stack(tokenizer)
    async with opened as stack:
        assert (await (await stack.client()).request(CHAT, chat_body(3))).status == 200
        handler = stack.api.handler
        arrivals: list[float] = []
        process = handler.process

        def recording(step: EngineOutputs) -> None:
            assert not step.outputs
            arrivals.append(trio.current_time())
            process(step)

        handler.process = recording  # type: ignore[method-assign]
        start = trio.current_time()
        await trio.sleep(10 * HEARTBEAT_INTERVAL + STEP)
        gaps = [b - a for a, b in zip([start, *arrivals], arrivals, strict=False)]
        assert len(arrivals) == 10
        assert gaps == pytest.approx([HEARTBEAT_INTERVAL] * 10, abs=STEP)
        # So the stats admission reads are never older than one interval while the engine idles.
        ((_, age),) = handler.engine_stats_ages(trio.current_time())
        assert age <= HEARTBEAT_INTERVAL < STATS_MAX_AGE


async def test_a_mock_engine_on_a_slow_clock_is_heard_from_mid_step(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    """The mock runs in the one engine-core shell, so it has the beat task too: with 3 s steps an API
    server still hears from it every heartbeat interval, and each mid-step message says how the step
    stands (the mock's own shell had no beat task: 3 s of silence per step)."""
    config = override(BASE_CONFIG, step_interval_us=3_000_000)
    async with trio.open_nursery() as nursery:
        stack = await start_stack(nursery, tokenizer, config)
        seen = record_engine_messages(stack)
        start = trio.current_time()
        reply = await (await stack.client()).request(CHAT, chat_body(3))
        assert reply.status == 200
        times = [start] + [t for t, _ in seen]
        assert max(b - a for a, b in itertools.pairwise(times)) <= HEARTBEAT_INTERVAL + STEP
        mid_step = [step.stats for _, step in seen if not step.outputs and step.stats.step_elapsed > 0]
        assert mid_step and all(s.step_tokens == 1 and not s.step_overdue for s in mid_step)
        nursery.cancel_scope.cancel()


async def test_engine_folds_reach_the_metrics(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    """``OutputPump.folded_steps`` (the engine held steps its socket would not take) is exported."""
    config = override(BASE_CONFIG, output_queue_size=4, engine_output_hwm=2, output_queue_policy="block")
    async with trio.open_nursery() as nursery:
        stack = await start_stack(nursery, tokenizer, config)
        queue = stack.api.steps
        fast_get = queue.get

        async def slow_get() -> EngineOutputs:  # an output handler three times slower than the engine
            await trio.sleep(3 * STEP)
            return await fast_get()

        queue.get = slow_get  # type: ignore[method-assign]
        assert (await (await stack.client()).request(CHAT, chat_body(120))).status == 200
        await trio.sleep(HEARTBEAT_INTERVAL)  # the idle report carries the final count
        folded = stack.engine.pump.folded_steps if stack.engine.pump else 0
        assert folded > 0
        assert sample(await metrics(stack), "trioserve:engine_folded_steps_total") == folded
        nursery.cancel_scope.cancel()
