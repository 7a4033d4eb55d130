"""An executor that fails (a worker died, hung or raised) ends the engine core with a reason every
client sees, whether it fails during a step or while the engine is idle; nothing hangs. One Trio run on
a MockClock, API server and engine core over inproc ZMQ."""

from __future__ import annotations

import itertools
import socket

import trio
import zmq
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, STEP_US
from tests.trio.http_client import HttpClient
from tests.trio.test_engine_core import scheduler_engine
from tests.trio.test_streaming import CHAT, chat_body
from trioserve.engine.core import EngineCore
from trioserve.engine.executor import ExecutorFailed, ReferenceExecutor
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.frontend.api_server import ApiServer, EngineAddresses
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.launch.serve import api_server
from trioserve.protocol.step import SchedulerOutput

STEP = STEP_US / 1e6
_ids = itertools.count()


class FailingExecutor(ReferenceExecutor):
    """The reference executor until step ``fail_at``, which raises like a dead worker would."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(num_blocks=256, block_size=4, vocab_size=32000, step_time=STEP)
        self.fail_at = fail_at
        self.calls = 0

    async def execute(self, step: SchedulerOutput) -> dict[str, list[int]]:
        self.calls += 1
        if self.calls == self.fail_at:
            await trio.sleep(STEP)
            raise ExecutorFailed("worker 0 died (killed by signal 9)")
        return await super().execute(step)


async def run_stack(
    nursery: trio.Nursery, tokenizer: Tokenizer, executor: FailingExecutor, errors: list[BaseException]
) -> tuple[ApiServer, EngineCore]:
    n = next(_ids)
    addresses = EngineAddresses(f"inproc://fhs-{n}", f"inproc://fin-{n}", f"inproc://fout-{n}")
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=BASE_CONFIG.model.max_model_len,
        num_blocks=256,
        block_size=4,
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    core = scheduler_engine(addresses.handshake, scheduler, executor, ctx)
    api = api_server(BASE_CONFIG, tokenizer, ctx, addresses)

    async def core_task() -> None:
        try:
            await core.run()
        except* ExecutorFailed as group:  # what ends the engine-core process (exit code 1)
            errors.extend(group.exceptions)

    nursery.start_soon(core_task)
    await nursery.start(api.run, None)
    return api, core


async def client_of(api: ApiServer, nursery: trio.Nursery) -> HttpClient:
    server_end, client_end = socket.socketpair()
    nursery.start_soon(api.http.handle_connection, server_end)
    await trio.lowlevel.checkpoint()
    return HttpClient(trio.socket.from_stdlib_socket(client_end))


async def test_failure_during_a_step_ends_every_stream_with_the_reason(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        api, _ = await run_stack(nursery, tokenizer, FailingExecutor(fail_at=6), errors)
        replies = []

        async def one() -> None:
            client = await client_of(api, nursery)
            replies.append(await client.request(CHAT, chat_body(100)))

        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                for _ in range(3):
                    clients.start_soon(one)
        health = await (await client_of(api, nursery)).request("/health", b"", method="GET")
        nursery.cancel_scope.cancel()
    assert [str(e) for e in errors] == ["worker 0 died (killed by signal 9)"]
    for reply in replies:
        assert reply.status == 200  # the streams had started
        tokens = sum(len(c["choices"][0]["token_ids"]) for c in reply.content_events())
        assert 0 < tokens < 100
        (error,) = [c["error"] for c in reply.chunks if "error" in c]
        assert "worker 0 died (killed by signal 9)" in error["message"]
        assert reply.events[-1].data == "[DONE]"
    assert health.status == 503


async def test_failure_while_idle_is_reported_at_once(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    errors: list[BaseException] = []
    executor = FailingExecutor(fail_at=0)  # never fails in a step: the failure comes while idle
    async with trio.open_nursery() as nursery:
        api, _ = await run_stack(nursery, tokenizer, executor, errors)
        ok = await (await client_of(api, nursery)).request(CHAT, chat_body(3))
        assert ok.status == 200
        await trio.sleep(1.0)  # idle: nothing scheduled
        executor.failure = ExecutorFailed("worker 0 died (exit code 1)")
        executor.on_failure()  # what the worker watcher does when the process exits
        await trio.sleep(STEP)
        assert [str(e) for e in errors] == ["worker 0 died (exit code 1)"]
        refused = await (await client_of(api, nursery)).request(CHAT, chat_body(3))
        nursery.cancel_scope.cancel()
    assert refused.status == 503
    assert "worker 0 died (exit code 1)" in refused.json()["error"]["message"]
