"""A hung worker or a stopped engine is visible (issue 11 item 5), on a MockClock.

A stalled engine is one whose running step its engine core reports overdue (``engine/step_watch.py``),
or from which nothing (step outputs, heartbeats, mid-step ones too) has arrived for longer than its
silence bound (``frontend/engine_health.py``). Then ``/health`` answers 503 naming it,
``trioserve:engine_stalled`` reads 1, a log line says so, and a new request is refused at once with
503 + ``Retry-After`` instead of hanging; when output resumes all of it goes back. A step that is
merely long (a CPU model's 2048-token prefill chunk after 10 ms decodes) is none of that.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import zmq
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack, start_stack
from tests.trio.http_client import HttpClient, Reply
from tests.trio.test_engine_core import CoreStack, RecordingExecutor, scheduler_engine, start_core_stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import override
from trioserve.engine import core as engine_core
from trioserve.engine.output_pump import OutputPump
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.engine.step_watch import STEP_FACTOR
from trioserve.frontend.api_server import EngineAddresses
from trioserve.frontend.engine_health import STALL_FLOOR
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.launch.serve import api_server
from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineOutputs
from trioserve.protocol.step import SchedulerOutput
from trioserve.runtime.sync import Waker

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
    wait_for_work = engine_core.wait_for_work

    async def stoppable(work: Waker, due: float) -> None:  # where an idle engine loop waits
        await engine.gate()
        await wait_for_work(work, due)

    monkeypatch.setattr(engine_core, "wait_for_work", stoppable)
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
    """Steps of 1.5 s (a CPU model's prefill chunks): mid-step heartbeats keep every gap within a
    heartbeat interval (silence bound 4 x 1 s), and the engine core's bound for each step follows the
    steps before it (4 x 1.5 s), so a slow but steady engine is never reported."""
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
            assert seen_bounds[-1] == pytest.approx(4 * HEARTBEAT_INTERVAL)
            assert stack.engine.step_watch.bound(1) == pytest.approx(STEP_FACTOR * 1.5)
            nursery.cancel_scope.cancel()


# ---- long steps: a 2048-token prefill chunk after fast decodes ------------------------------------------

LONG_STEP = 10.0  # seconds a step of more than 1000 tokens takes (SmolLM2-135M on CPU: 5-9 s for 2048)
LONG_PROMPT = [{"role": "user", "content": "word " * 1900}]  # ~1,900 tokens: one chunk
_long_ids = itertools.count()


class SizedExecutor(HangingExecutor):
    """Steps of more than 1000 scheduled tokens take ``LONG_STEP``, the others ``STEP``; stoppable."""

    async def execute(self, step: SchedulerOutput) -> dict[str, list[int]]:
        if step.total_num_scheduled_tokens > 1000:
            await trio.sleep(LONG_STEP - STEP)
        return await super().execute(step)


@asynccontextmanager
async def long_step_stack(tokenizer: Tokenizer) -> AsyncIterator[tuple[CoreStack, Freezer]]:
    """The engine core with the default step budget (2048 tokens) behind an API server."""
    n = next(_long_ids)
    addresses = EngineAddresses(f"inproc://lhs-{n}", f"inproc://lin-{n}", f"inproc://lout-{n}")
    scheduler = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096, num_blocks=4096, block_size=4
    )
    executor = SizedExecutor(4096, 4, 32000, STEP)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    engine = scheduler_engine(addresses.handshake, scheduler, executor, ctx)
    api = api_server(override(BASE_CONFIG, max_model_len=4096), tokenizer, ctx, addresses)
    assert isinstance(engine.core, SchedulerCore)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await nursery.start(api.run, None)
            yield CoreStack(api, engine, nursery, engine.core, executor), executor.freezer
            nursery.cancel_scope.cancel()


async def decode_then_long_prefill(stack: CoreStack) -> Reply:
    """A stream decoding in 10 ms steps for a while, then a ~1,900-token prompt: its chunk takes
    ``LONG_STEP``. Returns when that step has ended (the long request's reply, read to its end)."""
    stream = await stack.client()
    await stream.send_request(CHAT, chat_body(3000))
    events = await stream.read_body(await stream.read_head(), max_events=100)  # 100 fast decodes
    stack.nursery.start_soon(stream.read_body, events)  # it goes on throughout: keep reading it
    done = trio.Event()
    reply: list[Reply] = []

    async def long_request() -> None:
        reply.append(await (await stack.client()).request(CHAT, chat_body(5, messages=LONG_PROMPT)))
        done.set()

    stack.nursery.start_soon(long_request)
    await done.wait()
    return reply[0]


async def test_a_long_prefill_after_fast_decodes_is_not_a_stall(
    tokenizer: Tokenizer, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """10 s for a 1,900-token step after 10 ms decodes is within the engine core's bound for it
    (4 x 1,900 x 10 ms), and its mid-step heartbeats keep the API server hearing from it: ``/health``
    stays 200 and a request that arrives meanwhile is admitted (before, 3 s of silence was a stall)."""
    caplog.set_level(logging.INFO, "trioserve")
    async with long_step_stack(tokenizer) as (stack, _):
        watch = stack.engine.step_watch
        health_seen: list[int] = []
        admitted: list[Reply] = []

        async def newcomer() -> None:
            admitted.append(await (await stack.client()).request(CHAT, chat_body(3)))

        async def probe() -> None:
            sent = False
            while True:
                health_seen.append((await get(stack, "/health"))[0])
                assert stack.api.engine.stall() is None
                step = watch.running
                mid_long = step is not None and step.tokens > 1000 and trio.current_time() - step.started > 5
                if mid_long and not sent:  # a new request mid-way through the long step
                    probes.start_soon(newcomer)
                    sent = True
                await trio.sleep(0.25)

        async with trio.open_nursery() as probes:
            probes.start_soon(probe)
            reply = await decode_then_long_prefill(stack)
            await trio.sleep(1.0)
            probes.cancel_scope.cancel()
        assert reply.status == 200
        assert sum(len(c["choices"][0]["token_ids"]) for c in reply.content_events()) == 5
        long_steps = [d for t, d in watch._history if t > 1000]
        assert long_steps == [pytest.approx(LONG_STEP)]  # the long step did happen
        assert len(health_seen) > 40 and set(health_seen) == {200}
        assert admitted and admitted[0].status == 200  # arrived mid-step, served after it
        assert stack.api.serving.admission.rejected.get("engine_stalled", 0) == 0
        assert stack.api.engine.health[0].stall_count == 0
        assert not any("stalled" in r.getMessage() for r in caplog.records)


async def test_a_hung_step_after_a_long_one_is_a_stall_at_its_bound(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    """A decode that hangs right after the long step: heartbeats go on (the engine core runs), and
    the engine core reports the step overdue at its bound, 4 x the long step's 10 s (a small step is
    not assumed faster than a recent big one), then the API server refuses new requests."""
    async with long_step_stack(tokenizer) as (stack, worker):
        await decode_then_long_prefill(stack)
        worker.freeze()
        await trio.sleep(3 * STEP)  # the next forward has begun, and never returns
        watch = stack.engine.step_watch
        step = watch.running
        assert step is not None and step.tokens == 1  # the stream's decode
        bound = watch.bound(step.tokens)
        assert bound == pytest.approx(STEP_FACTOR * LONG_STEP)
        while trio.current_time() < step.started + bound - 0.01:
            assert (await get(stack, "/health"))[0] == 200  # alive, and not overdue yet
            await trio.sleep_until(min(trio.current_time() + 1.0, step.started + bound - 0.01))
        assert (await get(stack, "/health"))[0] == 200
        await trio.sleep(0.02)
        status, body = await get(stack, "/health")
        assert status == 503
        assert "engine 0 is stalled: its step of 1 tokens has run 40.0 s (bound 40.0 s)" in body
        refused = await (await stack.client()).request(CHAT, chat_body(3))
        assert refused.status == 503 and "its step of 1 tokens" in refused.json()["error"]["message"]
        worker.thaw()
        await trio.sleep(2 * STEP)
        assert (await get(stack, "/health"))[0] == 200
        assert stack.api.engine.health[0].stall_count == 1


async def test_a_stopped_engine_core_mid_step_is_detected_by_silence(
    tokenizer: Tokenizer, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP of the engine core during a step: no heartbeat leaves it either, and the API server's
    silence rule tells, after its silence bound, long before the step's own bound (40 s here)."""
    beat = OutputPump.beat
    stopped = False

    def stoppable_beat(
        pump: OutputPump, message: Callable[[], EngineOutputs], *, everyone: bool = False
    ) -> None:
        if not stopped:
            beat(pump, message, everyone=everyone)
            return
        now = trio.current_time()  # stopped: what it would send never leaves the process
        for client in pump.heartbeat.owed(now, has_work=True):
            pump.heartbeat.beat(client, now)

    monkeypatch.setattr(OutputPump, "beat", stoppable_beat)
    async with long_step_stack(tokenizer) as (stack, worker):
        await decode_then_long_prefill(stack)
        worker.freeze()  # the busy loop stops in its forward ...
        stopped = True  # ... and the beat task sends nothing: the whole process is stopped
        frozen_at = trio.current_time()
        health = stack.api.engine.health[0]
        silence_bound = health.bound()
        assert silence_bound <= STALL_FLOOR + 1.0 < stack.engine.step_watch.bound(1)
        await trio.sleep(silence_bound - 0.1)
        assert (await get(stack, "/health"))[0] == 200
        await trio.sleep(0.2)
        status, body = await get(stack, "/health")
        assert status == 503 and "engine 0 is stalled: nothing from it for" in body
        assert trio.current_time() - frozen_at < 2 * STALL_FLOOR
        stopped = False
        worker.thaw()  # SIGCONT
        await trio.sleep(2 * STEP)
        assert (await get(stack, "/health"))[0] == 200
