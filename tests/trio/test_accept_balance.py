"""Least-loaded accept (``accept_balance.py``) in the accept loop, on a MockClock.

These use real TCP sockets on 127.0.0.1 (a listener is what the balance sits in front of). Loopback
delivery normally happens inside the sending syscall, but on a loaded machine the kernel may finish it
a moment later, while the autojumping clock moves on; so the tests wait for what they expect
(``_until``) instead of for a fixed amount of mock time.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import Stack, start_stack
from tests.trio.http_client import HttpClient
from trioserve.frontend.edge.accept_balance import (
    ABSENT,
    DEFER_CHECKS,
    DEFER_INTERVAL,
    AcceptBalance,
    ConnectionLoads,
)
from trioserve.frontend.edge.http_server import HttpServer
from trioserve.frontend.text.tokenizer import Tokenizer

SETTLE = 0.01  # mock seconds: longer than a whole deferral (5 x 1 ms), so every wake has ended


@pytest.fixture
async def stack(tokenizer: Tokenizer, autojump_clock: MockClock) -> AsyncIterator[Stack]:
    async with trio.open_nursery() as nursery:
        yield await start_stack(nursery, tokenizer)
        nursery.cancel_scope.cancel()


@pytest.fixture
def loads_path(tmp_path: Path) -> Path:
    return tmp_path / "connections"


@contextmanager
def _listener() -> Iterator[socket.socket]:
    """A listening socket as the supervisor makes it (SO_REUSEPORT, like vLLM's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock
    finally:
        sock.close()


async def _connect(listener: socket.socket) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await sock.connect(listener.getsockname())
    return sock


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds: mock time for the servers to decide (at least ``SETTLE``
    after it holds, so every deferral has ended), real time for the kernel to deliver."""
    for _ in range(5000):
        await trio.sleep(SETTLE)
        if condition():
            await trio.sleep(SETTLE)
            return
        time.sleep(0.001)  # noqa: ASYNC251 -- real time on purpose: the kernel's, not Trio's
    raise AssertionError("the condition never held")


def _server(stack: Stack, balance: AcceptBalance | None) -> HttpServer:
    api = stack.api
    return HttpServer(api.serving, api.asgi, 1 << 20, accept_balance=balance)


# ---- the wait, in mock time --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "expected_checks"),
    [
        ([1, 3], 0),  # least loaded: races at once
        ([2, 2], 0),  # tied: races
        ([3, 1], DEFER_CHECKS),  # more loaded, nothing changes: the whole 5 ms, then races
        ([3, ABSENT], 0),  # the peer is not accepting
    ],
)
async def test_the_wait_takes_the_checks_the_rule_says(
    loads_path: Path, autojump_clock: MockClock, loads: list[int], expected_checks: int
) -> None:
    with ConnectionLoads.create(loads_path, 2) as shared, ConnectionLoads.open(loads_path, 2) as own:
        shared.publish(1, loads[1])
        balance = AcceptBalance(own, 0)
        start = trio.current_time()
        await balance.wait_turn(loads[0])
        assert trio.current_time() - start == pytest.approx(expected_checks * DEFER_INTERVAL)
        assert balance.deferrals == expected_checks
        assert balance.deferred_accepts == (expected_checks > 0)
        assert shared.read()[0] == loads[0]  # published for the peer to see


async def test_a_peer_that_takes_connections_meanwhile_ends_the_wait(
    loads_path: Path, autojump_clock: MockClock
) -> None:
    with ConnectionLoads.create(loads_path, 2) as peer, ConnectionLoads.open(loads_path, 2) as own:
        peer.publish(1, 1)
        balance = AcceptBalance(own, 0)

        async def peer_accepts() -> None:
            await trio.sleep(2.5 * DEFER_INTERVAL)
            peer.publish(1, 4)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer_accepts)
            await balance.wait_turn(3)
        # Checks at 0, 1 and 2 ms defer; the one at 3 ms sees 3 <= 4 and races.
        assert trio.current_time() - start == pytest.approx(3 * DEFER_INTERVAL)
        assert (balance.deferrals, balance.deferred_accepts) == (3, 1)


# ---- the accept loop ---------------------------------------------------------------------------


async def test_the_server_publishes_its_connections_as_they_open_and_close(
    stack: Stack, loads_path: Path, autojump_clock: MockClock
) -> None:
    with _listener() as listener, ConnectionLoads.create(loads_path, 2) as shared:
        balance = AcceptBalance(ConnectionLoads.open(loads_path, 2), 0)
        server = _server(stack, balance)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, listener)
            clients = []
            for n in range(1, 4):
                clients.append(await _connect(listener))
                await _until(lambda: server.connections == n)  # noqa: B023 -- called at once
                assert shared.read() == [n, ABSENT]
            reply = await HttpClient(clients[0]).request("/health", b"", method="GET")
            assert reply.status == 200  # a balanced server serves as any other
            clients.pop().close()
            await _until(lambda: server.connections == 2)
            assert shared.read() == [2, ABSENT]
            server.drain()  # it accepts no more: the peers must not defer to it
            assert shared.read()[0] == ABSENT
            for client in clients:
                client.close()
            await _until(lambda: server.connections == 0)
            assert shared.read()[0] == ABSENT  # closes after a drain do not un-retire it
            nursery.cancel_scope.cancel()
        assert balance.deferrals == 0  # the only published peer was absent
        balance.loads.close()


async def test_two_servers_on_one_socket_take_turns(
    stack: Stack, loads_path: Path, autojump_clock: MockClock
) -> None:
    """Eight connections opened one after another, each kept open, split four and four.

    Deterministic: on each connection both servers wake (each has its own descriptor of the one
    listening socket, as two processes would). The less loaded one races at once; the other defers
    until that one's published count makes them tied, or for 5 ms, then races and finds the queue
    empty. On a tie both race, and whichever Trio runs first wins. Either way the counts never differ
    by more than one, so after an even number they are equal, whatever the scheduling order.
    """
    with _listener() as listener, ConnectionLoads.create(loads_path, 2):
        peer_listener = listener.dup()  # the second "process"'s descriptor of the same socket
        loads = [ConnectionLoads.open(loads_path, 2) for _ in range(2)]
        balances = [AcceptBalance(loads[i], i) for i in range(2)]
        servers = [_server(stack, balance) for balance in balances]
        clients = []
        async with trio.open_nursery() as nursery:
            await nursery.start(servers[0].serve, listener)
            await nursery.start(servers[1].serve, peer_listener)
            for n in range(1, 9):
                clients.append(await _connect(listener))
                await _until(lambda: sum(server.connections for server in servers) == n)  # noqa: B023
                counts = [server.connections for server in servers]
                assert max(counts) - min(counts) <= 1, counts
                assert loads[0].read() == counts  # each sees the other's count
            assert [server.connections for server in servers] == [4, 4]
            # Every connection was raced for by both: one won it, the other found the queue empty.
            assert sum(balance.lost_races for balance in balances) == 8
            nursery.cancel_scope.cancel()
        for client in clients:
            client.close()
        peer_listener.close()
        for shared in loads:
            shared.close()
