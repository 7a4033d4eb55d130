"""Engine side of the start-up handshake (see ``protocol.messages``): join every API server.

The engine connects a DEALER to the handshake address, says Hello, and learns from Welcome which
sockets to connect to: a DEALER (identity = engine index) to each API server's ROUTER for requests, and a
PUSH to each API server's PULL for outputs. It then says Ready on each input DEALER, which is also how
each ROUTER learns the engine's identity before it routes a request to it.

An API server can be restarted while its engines run (``--api-server-count``: the supervisor starts a
new process at the same addresses). ZMQ reconnects the engine's sockets by itself, but the new process
has never heard Ready. So each input DEALER has a monitor: every completed connection handshake on it
(the first one too) makes the input pump say Ready again on that socket. An API server takes a repeated
Ready from an engine it knows as a no-op. With a DP coordinator (``Welcome.coordinator_address``), a
PUSH to it carries the engine's ``LoadReport``s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import trio
import zmq

from trioserve.protocol.codec import ProtocolError, handshake_codec
from trioserve.protocol.messages import PROTOCOL_VERSION, EngineHello, EngineReady, Welcome, engine_identity
from trioserve.transport.zmq_socket import HANDSHAKE_FAILED, TrioZmqSocket, wait_any_readable

log = logging.getLogger("trioserve.engine")


@dataclass(slots=True)
class EngineSockets:
    inputs: list[TrioZmqSocket]  # index = client_index
    outputs: list[TrioZmqSocket]  # index = client_index
    monitors: list[TrioZmqSocket]  # per input: its connection handshakes (say Ready again)
    ready_frame: bytes
    coordinator: TrioZmqSocket | None = None  # PUSH of LoadReports to the DP coordinator

    def close(self) -> None:
        for sock in (*self.inputs, *self.outputs, *self.monitors):
            sock.close()
        if self.coordinator is not None:
            self.coordinator.close()


async def join_frontends(
    ctx: zmq.Context[zmq.Socket[bytes]],
    handshake_address: str,
    ready: EngineReady,
    *,
    output_hwm: int = 1000,
) -> EngineSockets:
    codec = handshake_codec()
    hs = TrioZmqSocket.create(ctx, zmq.DEALER, connect=handshake_address)
    monitor = hs.monitor(HANDSHAKE_FAILED)
    try:
        await hs.send_multipart([codec.encode(EngineHello(ready.engine_index, os.getpid()))])
        refused = 0
        while (frames := hs.try_recv_multipart()) is None:
            if monitor.try_recv_multipart() is not None:
                refused += 1
                if refused == 1 or refused % 100 == 0:  # ZMQ retries every 100 ms: say it now and then
                    log.error(
                        "the API side at %s refused this engine's CURVE handshake %d times: is "
                        "--engine-secret the same on both hosts? (still trying)",
                        handshake_address,
                        refused,
                    )
                continue
            await wait_any_readable(hs, monitor)
        welcome = codec.decode(frames[-1])
    finally:
        monitor.close()
        hs.close()
    if not isinstance(welcome, Welcome):
        raise ProtocolError(f"expected Welcome in the handshake, got {type(welcome).__name__}")
    if welcome.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"API server speaks protocol {welcome.protocol_version}, this engine {PROTOCOL_VERSION}"
        )
    identity = engine_identity(ready.engine_index)
    ready_frame = codec.encode(ready)
    sockets = EngineSockets(inputs=[], outputs=[], monitors=[], ready_frame=ready_frame)
    for client in welcome.clients:
        dealer = TrioZmqSocket.create(ctx, zmq.DEALER, connect=client.input_address, identity=identity)
        sockets.inputs.append(dealer)
        sockets.monitors.append(dealer.monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED))
        sockets.outputs.append(
            TrioZmqSocket.create(ctx, zmq.PUSH, connect=client.output_address, sndhwm=output_hwm)
        )
    if welcome.coordinator_address:
        # A few reports queued at most: a newer one replaces what an old one said.
        sockets.coordinator = TrioZmqSocket.create(
            ctx, zmq.PUSH, connect=welcome.coordinator_address, sndhwm=16
        )
    for sock in sockets.inputs:
        await sock.send_multipart([ready_frame])
    await trio.lowlevel.checkpoint()
    return sockets
