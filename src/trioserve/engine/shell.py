"""What every engine process shares around its own busy loop: joining the API servers, an input
pump per API server, the output pump, waiting for work between heartbeats, and running until a
signal or the parent's death.

A defensive rule on the input side (``RecentAborts``): an add that arrives after an abort of the same
request id is dropped. API servers never send one (their engine client drops a queued add instead of
sending its abort ahead of it); this keeps a request that somehow overtook its own abort from running
to ``max_tokens`` with nobody reading it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import trio
import zmq

from trioserve.engine.handshake import join_frontends
from trioserve.engine.output_pump import OutputPolicy, OutputPump
from trioserve.launch.process import exit_on_signals, exit_when_parent_dies
from trioserve.protocol.codec import ProtocolError, engine_input_codec
from trioserve.protocol.messages import AbortRequests, AddRequest, EngineInput, EngineReady
from trioserve.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve.engine")


async def run_engine(
    ctx: zmq.Context[zmq.Socket[bytes]],
    handshake_address: str,
    ready: EngineReady,
    *,
    output_hwm: int,
    output_policy: OutputPolicy,
    on_input: Callable[[EngineInput], None],
    busy_loop: Callable[[OutputPump], Awaitable[None]],
    beside: Callable[[OutputPump], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Join, start the pumps (and ``beside``, a task that runs as long as the busy loop), then run
    ``busy_loop`` until it returns (a shutdown request)."""
    sockets = await join_frontends(ctx, handshake_address, ready, output_hwm=output_hwm)
    try:
        async with trio.open_nursery() as nursery:
            for sock in sockets.inputs:
                nursery.start_soon(_input_pump, sock, on_input)
            pump = OutputPump(sockets.outputs, output_policy)
            if output_policy == "fold":
                nursery.start_soon(pump.run)
            if beside is not None:
                nursery.start_soon(beside, pump)
            task_status.started()
            await busy_loop(pump)
            nursery.cancel_scope.cancel()
    finally:
        sockets.close()


async def wait_for_work(work: Waker, pump: OutputPump) -> None:
    """An idle busy loop's wait: until ``work`` is set or the next heartbeat is due, whichever comes
    first (the caller then sends what ``pump.send_stats`` says is owed and looks for work again)."""
    with trio.move_on_at(pump.heartbeat.next_due()):
        await work.wait()


class RecentAborts:
    """The last ``capacity`` request ids aborted through one API server's socket. Request ids are
    unique across the deployment, so an add for one of them arrived after its own abort and must not
    run. Bounded: a set for lookups and a FIFO that forgets the oldest id (an add overtaken by more
    than ``capacity`` aborts is not caught; the API server's ordering is the real guarantee)."""

    __slots__ = ("_ids", "_order", "capacity", "dropped")

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: set[str] = set()
        self._order: deque[str] = deque()
        self.dropped = 0  # adds refused because their abort came first

    def remember(self, request_ids: Iterable[str]) -> None:
        ids, order = self._ids, self._order
        for rid in request_ids:
            if rid in ids:
                continue
            ids.add(rid)
            order.append(rid)
            if len(order) > self.capacity:
                ids.discard(order.popleft())

    def overtaken(self, request_id: str) -> bool:
        """Whether an add for ``request_id`` comes after its abort (it is then counted, and dropped
        by the caller)."""
        if request_id in self._ids:
            self.dropped += 1
            return True
        return False


async def _input_pump(sock: TrioZmqSocket, on_input: Callable[[EngineInput], None]) -> None:
    """One per API server: decode each frame and hand it over; a bad frame is logged and dropped, and
    so is an add whose abort came first (``RecentAborts``)."""
    codec = engine_input_codec()
    aborts = RecentAborts()
    while True:
        frames = await sock.recv_multipart()
        try:
            msg = codec.decode(frames[-1])
        except ProtocolError as exc:
            log.warning("dropping frame: %s", exc)
            continue
        match msg:
            case AbortRequests(request_ids=ids):
                aborts.remember(ids)
            case AddRequest(request_id=rid) if aborts.overtaken(rid):
                log.warning("dropping request %s: its abort arrived first", rid)
                continue
        on_input(msg)


async def run_engine_process(main: Callable[[zmq.Context[zmq.Socket[bytes]]], Awaitable[None]]) -> None:
    """An engine process's top level: ``main`` with a fresh ZMQ context, until it returns, a SIGINT or
    SIGTERM arrives, or the API server that started us is gone."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        async with trio.open_nursery() as nursery:

            async def cancel_when_done(waiter: Callable[[], Awaitable[None]]) -> None:
                await waiter()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_when_done, exit_on_signals)
            nursery.start_soon(cancel_when_done, exit_when_parent_dies)
            await main(ctx)
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
