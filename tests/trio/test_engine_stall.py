"""A hung worker or a stopped engine is visible (issue 11 item 5), on a MockClock.

A stalled engine is one from which nothing (step outputs, heartbeats) has arrived for longer than its
stall bound (``frontend/engine_health.py``). Then ``/health`` answers 503 naming it,
``trioserve:engine_stalled`` reads 1, a log line says so, and a new request is refused at once with
503 + ``Retry-After`` instead of hanging; when output resumes all of it goes back.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.http_client import HttpClient
from tests.trio.test_engine_core import RecordingExecutor, start_core_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.engine.output_pump import OutputPump
from trioserve.engine.scheduler import SchedulerOutput
from trioserve.frontend.engine_health import STALL_FLOOR
from trioserve.frontend.tokenizer import Tokenizer
from trioserve.mock import engine as mock_engine
from trioserve.sync import Waker

STEP = STEP_US / 1e6


def sample(text: str, name: str) -> float:
    match = re.search(re.escape(name) + r"\{[^}]*\} (\S+)", text)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


async def get(stack: Stack, path: str) -> tuple[int, str]:
    reply = await (await stack.client()).request(path, b"", method="GET")
    return reply.status, reply.body.decode()


class Freezer:
    """A switch that stops a busy loop where it stands, as SIGSTOP stops a process."""

    def __init__(self) -> None:
        self.frozen = False
        self._thaw = trio.Event()

    def freeze(self) -> None:
        self.frozen, self._thaw = True, trio.Event()

    def thaw(self) -> None:
        self.frozen = False
        self._thaw.set()

    async def gate(self) -> None:
        if self.frozen:
            await self._thaw.wait()


class HangingExecutor(RecordingExecutor):
    """The reference executor behind a worker that can be stopped mid-forward (SIGSTOP)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.freezer = Freezer()

    async def execute(self, step: SchedulerOutput) -> dict[str, list[int]]:
        await self.freezer.gate()
        return await super().execute(step)


@asynccontextmanager
async def hanging_core_stack(tokenizer: Tokenizer) -> AsyncIterator[tuple[Stack, Freezer]]:
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            stack = await start_core_stack(nursery, tokenizer, num_blocks=1024)
            executor = HangingExecutor(1024, 4, 32000, STEP)
            stack.core.executor = executor  # before any step: the engine core reads it per step
            yield stack, executor.freezer
            nursery.cancel_scope.cancel()


async def test_a_hung_worker_with_streams_running_is_reported_and_refused_fast(
    tokenizer: Tokenizer, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "trioserve.frontend")
    async with hanging_core_stack(tokenizer) as (stack, worker):
        streams: list[HttpClient] = []
        for _ in range(8):
            client = await stack.client()
            await client.send_request(CHAT, chat_body(300))
            streams.append(client)
        replies = [await c.read_body(await c.read_head(), max_events=3) for c in streams]
        assert (await get(stack, "/health"))[0] == 200

        worker.freeze()  # the next forward never returns: clients get silence
        await trio.sleep(STALL_FLOOR - 0.1)
        status, _ = await get(stack, "/health")
        assert status == 200  # not yet: the bound is the floor (10 ms steps)
        await trio.sleep(0.2)
        status, body = await get(stack, "/health")
        assert status == 503
        assert "engine 0 is stalled" in body
        assert sample((await get(stack, "/metrics"))[1], "trioserve:engine_stalled") == 1
        assert any("engine 0 stalled" in r.getMessage() for r in caplog.records)

        asked = trio.current_time()
        refused = await (await stack.client()).request(CHAT, chat_body(5))
        assert trio.current_time() == asked  # refused without waiting for anything
        assert refused.status == 503
        assert refused.headers[b"retry-after"] == b"1"
        assert "engine 0 is stalled" in refused.json()["error"]["message"]
        assert stack.api.serving.admission.rejected["engine_stalled"] == 1

        worker.thaw()  # SIGCONT: the forward returns, steps resume
        await trio.sleep(2 * STEP)
        assert (await get(stack, "/health"))[0] == 200
        text = (await get(stack, "/metrics"))[1]
        assert sample(text, "trioserve:engine_stalled") == 0
        assert sample(text, "trioserve:engine_stall_episodes_total") == 1
        assert any("engine 0 resumed" in r.getMessage() for r in caplog.records)
        # The streams that waited go on to their end; new requests are served again.
        for client, reply in zip(streams, replies, strict=True):
            await client.read_body(reply)
            assert sum(len(c["choices"][0]["token_ids"]) for c in reply.content_events()) == 300
        assert (await (await stack.client()).request(CHAT, chat_body(5))).status == 200


async def test_a_stopped_idle_engine_is_detected_by_its_missing_heartbeat(
    tokenizer: Tokenizer, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Freezer()
    wait_for_work = mock_engine.wait_for_work

    async def stoppable(work: Waker, pump: OutputPump) -> None:  # where an idle engine loop waits
        await engine.gate()
        await wait_for_work(work, pump)

    monkeypatch.setattr(mock_engine, "wait_for_work", stoppable)
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            stack = await start_stack(nursery, tokenizer, BASE_CONFIG)
            assert (await (await stack.client()).request(CHAT, chat_body(3))).status == 200
            await trio.sleep(30)  # idle for a long while: heartbeats keep it healthy
            assert (await get(stack, "/health"))[0] == 200
            engine.freeze()
            await trio.sleep(1.0)  # the heartbeat it was about to send never comes
            assert (await get(stack, "/health"))[0] == 200
            await trio.sleep(STALL_FLOOR)
            status, body = await get(stack, "/health")
            assert status == 503 and "engine 0 is stalled" in body
            refused = await (await stack.client()).request(CHAT, chat_body(3))
            assert refused.status == 503 and refused.headers[b"retry-after"] == b"1"
            engine.thaw()
            await trio.sleep(STEP)
            assert (await get(stack, "/health"))[0] == 200
            assert (await (await stack.client()).request(CHAT, chat_body(3))).status == 200
            nursery.cancel_scope.cancel()


async def test_a_slow_but_steady_engine_is_never_stalled(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    """Steps of 1.5 s (a CPU model's prefill chunks): the bound grows with the measured intervals
    (4 x 1.5 s), so a slow but steady engine is never reported."""
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            stack = await start_core_stack(nursery, tokenizer, num_blocks=1024)
            stack.core.executor.step_time = 1.5  # type: ignore[attr-defined]
            client = await stack.client()
            await client.send_request(CHAT, chat_body(40))
            reply = await client.read_head()
            seen_bounds = []
            for _ in range(40):
                await trio.sleep(1.5)
                assert stack.api.engine.stall() is None
                seen_bounds.append(stack.api.engine.health[0].bound())
            await client.read_body(reply)
            assert seen_bounds[-1] == pytest.approx(4 * 1.5)
            nursery.cancel_scope.cancel()
