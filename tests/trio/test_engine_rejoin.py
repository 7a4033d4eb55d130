"""An engine that dies is replaced by one that joins at the same handshake address: the API server
takes the new handshake, serving resumes, and nothing of the dead engine's requests leaks into the new
one. One Trio run on a MockClock, API server and engine cores over inproc ZMQ."""

from __future__ import annotations

import itertools
import os

import pytest
import trio
import zmq
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US
from tests.trio.test_engine_core import scheduler_engine
from tests.trio.test_engine_failure import FailingExecutor, client_of
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.engine.core import EngineCore
from trioserve.engine.executor import Executor, ExecutorFailed, ReferenceExecutor
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.frontend.api_server import EngineAddresses
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.launch.serve import api_server

STEP = STEP_US / 1e6
_ids = itertools.count()


def engine_core(handshake: str, executor: Executor, ctx: zmq.Context[zmq.Socket[bytes]]) -> EngineCore:
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=BASE_CONFIG.model.max_model_len,
        num_blocks=256,
        block_size=4,
    )
    return scheduler_engine(handshake, scheduler, executor, ctx)


async def run_core(core: EngineCore, errors: list[BaseException], ended: trio.Event | None = None) -> None:
    try:
        await core.run()
    except* ExecutorFailed as group:  # what ends an engine-core process (exit code 1)
        errors.extend(group.exceptions)
    finally:
        if ended is not None:
            ended.set()


async def test_a_replacement_engine_joins_and_serving_resumes(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    n = next(_ids)
    addresses = EngineAddresses(f"inproc://rhs-{n}", f"inproc://rin-{n}", f"inproc://rout-{n}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    api = api_server(BASE_CONFIG, tokenizer, ctx, addresses)
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        first = FailingExecutor(fail_at=6)
        first_ended = trio.Event()
        core = engine_core(addresses.handshake, first, ctx)
        nursery.start_soon(run_core, core, errors, first_ended)
        await nursery.start(api.run, None)
        assert api.engine.joins == 1

        with trio.fail_after(60):
            doomed = await (await client_of(api, nursery)).request(CHAT, chat_body(100))
            await first_ended.wait()  # the engine core ends just after its EngineDead went out
        assert [str(e) for e in errors] == ["worker 0 died (killed by signal 9)"]
        (error,) = [c["error"] for c in doomed.chunks if "error" in c]
        assert "worker 0 died" in error["message"]
        assert doomed.events[-1].data == "[DONE]"
        assert api.engine.dead_report is not None
        health = await (await client_of(api, nursery)).request("/health", b"", method="GET")
        assert health.status == 503
        refused = await (await client_of(api, nursery)).request(CHAT, chat_body(3))
        assert refused.status == 503
        assert refused.headers[b"retry-after"] == b"1"

        # The replacement (what the supervisor starts in its own process) joins at the same address.
        second = ReferenceExecutor(num_blocks=256, block_size=4, vocab_size=32000, step_time=STEP)
        nursery.start_soon(run_core, engine_core(addresses.handshake, second, ctx), errors)
        with trio.fail_after(60):
            while api.engine.joins < 2:
                await api.engine.link_changed()
        assert api.engine.dead_report is None
        assert api.serving.dead_reason is None
        health = await (await client_of(api, nursery)).request("/health", b"", method="GET")
        assert health.status == 200
        with trio.fail_after(60):
            ok = await (await client_of(api, nursery)).request(CHAT, chat_body(5))
        assert ok.status == 200
        assert sum(len(c["choices"][0]["token_ids"]) for c in ok.content_events()) == 5
        assert ok.events[-1].data == "[DONE]"
        nursery.cancel_scope.cancel()
    assert len(errors) == 1


async def test_an_engine_replaced_before_reporting_its_end_fails_its_requests(
    tokenizer: Tokenizer, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An external engine killed and started again joins with a new pid and knows none of the old
    one's requests: they end with an error instead of waiting forever."""
    n = next(_ids)
    addresses = EngineAddresses(f"inproc://xhs-{n}", f"inproc://xin-{n}", f"inproc://xout-{n}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    api = api_server(BASE_CONFIG, tokenizer, ctx, addresses)
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        slow = ReferenceExecutor(num_blocks=256, block_size=4, vocab_size=32000, step_time=STEP)
        first = engine_core(addresses.handshake, slow, ctx)
        old_engine = trio.CancelScope()

        async def run_first() -> None:
            with old_engine:
                await run_core(first, errors)

        nursery.start_soon(run_first)
        await nursery.start(api.run, None)
        client = await client_of(api, nursery)
        await client.send_request(CHAT, chat_body(400))
        reply = await client.read_body(await client.read_head(), max_events=3)
        old_engine.cancel()  # it vanishes without a word (as a SIGKILLed process would)
        monkeypatch.setattr(os, "getpid", lambda: 424242)  # the replacement is another process
        fast = ReferenceExecutor(num_blocks=256, block_size=4, vocab_size=32000, step_time=STEP)
        nursery.start_soon(run_core, engine_core(addresses.handshake, fast, ctx), errors)
        with trio.fail_after(30):
            await client.read_body(reply)
        (error,) = [c["error"] for c in reply.chunks if "error" in c]
        assert "was replaced by pid 424242" in error["message"]
        assert reply.events[-1].data == "[DONE]"
        with trio.fail_after(30):
            ok = await (await client_of(api, nursery)).request(CHAT, chat_body(5))
        assert ok.status == 200 and ok.events[-1].data == "[DONE]"
        nursery.cancel_scope.cancel()
