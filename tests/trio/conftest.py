"""An API server and a mock engine core in one Trio run, on a MockClock, over real inproc ZMQ.

HTTP clients talk to the API server through a socketpair handed to its connection handler, so bytes
arrive synchronously and the autojumping clock only moves when every task is truly waiting.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import trio
import trio.testing
import zmq

from tests.trio.http_client import HttpClient
from trioserve.config import ServeConfig, override
from trioserve.engine.core import EngineCore
from trioserve.engine.main import mock_core
from trioserve.frontend.api_server import ApiServer, EngineAddresses
from trioserve.frontend.text.tokenizer import Tokenizer, load_tokenizer
from trioserve.launch.serve import api_server

STEP_US = 10_000
_ids = itertools.count()


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@dataclass
class Stack:
    api: ApiServer
    engine: EngineCore
    nursery: trio.Nursery

    async def client(self, rcvbuf: int | None = None) -> HttpClient:
        server_end, client_end = socket.socketpair()
        if rcvbuf is not None:
            for s in (server_end, client_end):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.nursery.start_soon(self.api.http.handle_connection, server_end)
        await trio.lowlevel.checkpoint()
        return HttpClient(trio.socket.from_stdlib_socket(client_end))


# Rendering on the event loop: a renderer thread would let the autojumping clock move by an arbitrary
# amount while it runs, so request start times would not be deterministic.
BASE_CONFIG = override(ServeConfig(), max_model_len=512, step_interval_us=STEP_US, renderer_num_workers=0)


async def start_stack(
    nursery: trio.Nursery, tokenizer: Tokenizer, config: ServeConfig = BASE_CONFIG, **engine_overrides: object
) -> Stack:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    n = next(_ids)
    handshake = f"inproc://hs-{n}"
    addresses = EngineAddresses(handshake, f"inproc://in-{n}", f"inproc://out-{n}")
    process = override(config.engine_process(handshake), **engine_overrides)
    engine = EngineCore(process.engine, mock_core(process), ctx)
    api = api_server(config, tokenizer, ctx, addresses)
    nursery.start_soon(engine.run)
    await nursery.start(api.run, None)
    return Stack(api, engine, nursery)


@pytest.fixture
async def stack(tokenizer: Tokenizer, autojump_clock: trio.testing.MockClock) -> AsyncIterator[Stack]:
    async with trio.open_nursery() as nursery:
        yield await start_stack(nursery, tokenizer)
        nursery.cancel_scope.cancel()
