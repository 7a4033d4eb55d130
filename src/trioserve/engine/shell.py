"""What every engine process shares around its own busy loop: joining the API servers, an input
pump per API server, the output pump, and running until a signal or the parent's death."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
import zmq

from trioserve.engine.handshake import join_frontends
from trioserve.engine.output_pump import OutputPolicy, OutputPump
from trioserve.launch.process import exit_on_signals, exit_when_parent_dies
from trioserve.protocol.codec import ProtocolError, engine_input_codec
from trioserve.protocol.messages import EngineInput, EngineReady
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
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Join, start the pumps, then run ``busy_loop`` until it returns (a shutdown request)."""
    sockets = await join_frontends(ctx, handshake_address, ready, output_hwm=output_hwm)
    try:
        async with trio.open_nursery() as nursery:
            for sock in sockets.inputs:
                nursery.start_soon(_input_pump, sock, on_input)
            pump = OutputPump(sockets.outputs, output_policy)
            if output_policy == "fold":
                nursery.start_soon(pump.run)
            task_status.started()
            await busy_loop(pump)
            nursery.cancel_scope.cancel()
    finally:
        sockets.close()


async def _input_pump(sock: TrioZmqSocket, on_input: Callable[[EngineInput], None]) -> None:
    """One per API server: decode each frame and hand it over; a bad frame is logged and dropped."""
    codec = engine_input_codec()
    while True:
        frames = await sock.recv_multipart()
        try:
            msg = codec.decode(frames[-1])
        except ProtocolError as exc:
            log.warning("dropping frame: %s", exc)
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
