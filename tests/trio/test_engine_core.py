"""The engine-core shell (scheduler + KV ledger + reference executor) behind the API server, in one
Trio run on a MockClock, over real inproc ZMQ."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import trio
import zmq
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US, Stack
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.config import EngineConfig
from trioserve.engine.core import EngineCore
from trioserve.engine.executor import Executor, ReferenceExecutor
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.scheduler_core import SchedulerCore
from trioserve.frontend.api_server import EngineAddresses
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.launch.serve import api_server
from trioserve.protocol.step import SchedulerOutput

STEP = STEP_US / 1e6
_ids = itertools.count()


class RecordingExecutor(ReferenceExecutor):
    """The reference executor, remembering which requests each step computed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.steps: list[set[str]] = []

    async def execute(self, step: SchedulerOutput) -> dict[str, list[int]]:
        self.steps.append(set(step.num_scheduled_tokens))
        return await super().execute(step)


def scheduler_engine(
    handshake: str, scheduler: SchedulerConfig, executor: Executor, ctx: zmq.Context[zmq.Socket[bytes]]
) -> EngineCore:
    """The engine-core shell around the scheduler and ``executor`` (what ``--engine reference`` runs)."""
    core = SchedulerCore(scheduler, executor, vocab_size=32000)
    return EngineCore(EngineConfig(handshake_address=handshake), core, ctx)


@dataclass
class CoreStack(Stack):
    core: SchedulerCore  # ``engine.core``
    executor: RecordingExecutor


async def start_core_stack(nursery: trio.Nursery, tokenizer: Tokenizer, num_blocks: int) -> CoreStack:
    n = next(_ids)
    addresses = EngineAddresses(f"inproc://chs-{n}", f"inproc://cin-{n}", f"inproc://cout-{n}")
    scheduler = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=64,
        max_model_len=BASE_CONFIG.model.max_model_len,
        num_blocks=num_blocks,
        block_size=4,
    )
    executor = RecordingExecutor(num_blocks, 4, 32000, STEP)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    engine = scheduler_engine(addresses.handshake, scheduler, executor, ctx)
    api = api_server(BASE_CONFIG, tokenizer, ctx, addresses)
    nursery.start_soon(engine.run)
    await nursery.start(api.run, None)
    assert isinstance(engine.core, SchedulerCore)
    return CoreStack(api, engine, nursery, engine.core, executor)


@pytest.fixture
async def core_stack(tokenizer: Tokenizer, autojump_clock: MockClock) -> AsyncIterator[CoreStack]:
    async with trio.open_nursery() as nursery:
        yield await start_core_stack(nursery, tokenizer, num_blocks=512)
        nursery.cancel_scope.cancel()


async def test_streams_through_the_engine_core(core_stack: CoreStack, autojump_clock: MockClock) -> None:
    reply = await (await core_stack.client()).request(CHAT, chat_body(20))
    assert reply.status == 200
    assert sum(len(c["choices"][0]["token_ids"]) for c in reply.content_events()) == 20
    assert not core_stack.core.scheduler.has_work
    assert core_stack.core.scheduler.ledger.num_used_blocks == 0


async def test_abort_lands_after_exactly_the_current_step(
    core_stack: CoreStack, autojump_clock: MockClock
) -> None:
    client = await core_stack.client()
    await client.send_request(CHAT, chat_body(200))
    await client.read_body(await client.read_head(), max_events=5)
    scheduler = core_stack.core.scheduler
    (rid,) = scheduler.requests
    aborted_in_step: list[int] = []
    original = scheduler.abort

    def recording_abort(ids: list[str]) -> None:
        aborted_in_step.append(len(core_stack.executor.steps))
        original(ids)

    scheduler.abort = recording_abort  # type: ignore[method-assign]
    client.close()
    await trio.sleep(5 * STEP)
    assert aborted_in_step, "the abort never reached the engine"
    steps_with_it = [i for i, step in enumerate(core_stack.executor.steps) if rid in step]
    # The abort was applied right after the forward that was running when it arrived: no later step
    # computed the request.
    assert max(steps_with_it) < aborted_in_step[0]
    assert not scheduler.has_work and scheduler.ledger.num_used_blocks == 0


async def test_a_request_that_never_fits_is_refused_not_starved(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    async with trio.open_nursery() as nursery:
        stack = await start_core_stack(nursery, tokenizer, num_blocks=8)  # 32 token slots in all
        client = await stack.client()
        refused = await client.request(CHAT, chat_body(100))
        assert refused.status == 400
        assert "block" in refused.json()["error"]["message"]
        fits = await client.request(CHAT, chat_body(4))  # and the engine still serves others
        assert fits.status == 200
        nursery.cancel_scope.cancel()


async def test_preempted_requests_finish_with_the_tokens_of_an_unpreempted_run(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    async def run(num_blocks: int) -> tuple[list[list[int]], int]:
        async with trio.open_nursery() as nursery:
            stack = await start_core_stack(nursery, tokenizer, num_blocks)
            results: list[list[int]] = [[] for _ in range(4)]

            async def one(i: int) -> None:
                body = chat_body(24, messages=[{"role": "user", "content": f"story number {i}"}])
                reply = await (await stack.client()).request(CHAT, body)
                results[i] = [t for c in reply.content_events() for t in c["choices"][0]["token_ids"]]

            async with trio.open_nursery() as clients:
                for i in range(4):
                    clients.start_soon(one, i)
            preemptions = stack.core.scheduler.stats().num_preemptions
            nursery.cancel_scope.cancel()
        return results, preemptions

    roomy, none = await run(512)
    tight, some = await run(16)  # 64 slots for 4 requests of ~16 prompt + 24 output tokens
    assert none == 0 and some > 0
    assert all(len(r) == 24 for r in roomy)
    assert tight == roomy


async def test_engine_metrics_reach_the_api_servers_metrics(
    core_stack: CoreStack, autojump_clock: MockClock
) -> None:
    client = await core_stack.client()
    for _ in range(2):  # the second is a prefix-cache hit on the first one's prompt blocks
        assert (await client.request(CHAT, chat_body(4))).status == 200
    text = (await (await core_stack.client()).request("/metrics", b"", method="GET")).body.decode()
    stats = core_stack.core.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    assert f'vllm:prefix_cache_hits_total{{model_name="trioserve-mock"}} {stats.prefix_cache_hits}' in text
    assert 'vllm:request_queue_time_seconds_count{model_name="trioserve-mock"} 2' in text
