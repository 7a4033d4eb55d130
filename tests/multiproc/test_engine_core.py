"""``serve --engine reference``: the real engine-core process (scheduler, KV ledger, prefix cache,
reference executor) behind the API server, over ipc ZMQ."""

from __future__ import annotations

import trio

from ._support import chat_body, proc_title, request_json
from .conftest import ServerProcess


async def test_engine_core_process_serves_and_is_deterministic(reference_server: ServerProcess) -> None:
    s = reference_server
    assert proc_title(s.engine_pid) == "trioserve::EngineCore"
    body = chat_body(16, return_token_ids=True)
    status, first = await request_json(s.host, s.port, "POST", "/v1/chat/completions", body)
    assert status == 200, first
    ids = first["choices"][0]["token_ids"]
    assert len(ids) == 16 and first["usage"]["completion_tokens"] == 16
    # The reference model is a function of the sequence: the same prompt (now a prefix-cache hit)
    # gives the same tokens, and so do four at once on a pool small enough to force preemption.
    results: list[list[int]] = []

    async def one() -> None:
        code, reply = await request_json(s.host, s.port, "POST", "/v1/chat/completions", body)
        assert code == 200, reply
        results.append(reply["choices"][0]["token_ids"])

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
    assert results == [ids] * 4


async def test_engine_core_refuses_a_request_the_pool_can_never_hold(reference_server: ServerProcess) -> None:
    s = reference_server
    status, reply = await request_json(s.host, s.port, "POST", "/v1/chat/completions", chat_body(200))
    assert status == 400
    assert "block" in reply["error"]["message"]
