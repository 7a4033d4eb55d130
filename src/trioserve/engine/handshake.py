"""Engine side of the start-up handshake (see ``protocol.messages``): join every API server.

The engine connects a DEALER to the handshake address, says Hello, and learns from Welcome which
sockets to connect to: a DEALER (identity = engine index) to each API server's ROUTER for requests, and a
PUSH to each API server's PULL for outputs. It then says Ready on each input DEALER, which is also how
each ROUTER learns the engine's identity before it routes a request to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import trio
import zmq

from trioserve.protocol.codec import ProtocolError, handshake_codec
from trioserve.protocol.messages import PROTOCOL_VERSION, EngineHello, EngineReady, Welcome, engine_identity
from trioserve.transport.zmq_socket import TrioZmqSocket


@dataclass(slots=True)
class EngineSockets:
    inputs: list[TrioZmqSocket]  # index = client_index
    outputs: list[TrioZmqSocket]  # index = client_index

    def close(self) -> None:
        for sock in (*self.inputs, *self.outputs):
            sock.close()


async def join_frontends(
    ctx: zmq.Context[zmq.Socket[bytes]],
    handshake_address: str,
    ready: EngineReady,
    *,
    output_hwm: int = 1000,
) -> EngineSockets:
    codec = handshake_codec()
    hs = TrioZmqSocket.create(ctx, zmq.DEALER, connect=handshake_address)
    try:
        await hs.send_multipart([codec.encode(EngineHello(ready.engine_index, os.getpid()))])
        (frame,) = await hs.recv_multipart()
        welcome = codec.decode(frame)
    finally:
        hs.close()
    if not isinstance(welcome, Welcome):
        raise ProtocolError(f"expected Welcome in the handshake, got {type(welcome).__name__}")
    if welcome.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"API server speaks protocol {welcome.protocol_version}, this engine {PROTOCOL_VERSION}"
        )
    identity = engine_identity(ready.engine_index)
    sockets = EngineSockets(inputs=[], outputs=[])
    for client in welcome.clients:
        sockets.inputs.append(
            TrioZmqSocket.create(ctx, zmq.DEALER, connect=client.input_address, identity=identity)
        )
        sockets.outputs.append(
            TrioZmqSocket.create(ctx, zmq.PUSH, connect=client.output_address, sndhwm=output_hwm)
        )
    ready_frame = codec.encode(ready)
    for sock in sockets.inputs:
        await sock.send_multipart([ready_frame])
    await trio.lowlevel.checkpoint()
    return sockets
