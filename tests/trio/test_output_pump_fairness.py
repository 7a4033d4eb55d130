"""The engine's output pump (``fold``): a client whose socket is full never holds up the others.

A dead API server that the supervisor is restarting is exactly that client: ZMQ queues for it up to
the high-water mark, and then its socket is full until the new process connects. Before the rule, the
sender task parked on that socket and every other API server heard nothing: their engine looked
stalled.
"""

from __future__ import annotations

import itertools

import trio
import zmq

from trioserve.engine.output_pump import OutputPump
from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.messages import EngineOutputs, EngineStats, RequestOutput
from trioserve.transport.zmq_socket import TrioZmqSocket

_ids = itertools.count()


def step(n: int, rid: str) -> EngineOutputs:
    return EngineOutputs(0, n, 0.0, [RequestOutput(rid, [n])], EngineStats(0, 1))


async def test_a_full_client_socket_does_not_stop_the_others() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    n = next(_ids)
    # Client 0 reads; client 1's reader exists but never reads (HWM 1 on both ends: full at once).
    readers = [
        TrioZmqSocket.create(ctx, zmq.PULL, bind=f"inproc://pump-fair-{n}-{i}", rcvhwm=1) for i in range(2)
    ]
    pushes = [
        TrioZmqSocket.create(ctx, zmq.PUSH, connect=f"inproc://pump-fair-{n}-{i}", sndhwm=1) for i in range(2)
    ]
    pump = OutputPump(pushes, "fold")
    codec = engine_output_codec()
    got: list[int] = []
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump.run)
                for i in range(200):
                    await pump.send(0, step(i, "a"))
                    await pump.send(1, step(i, "b"))
                    frames = readers[0].try_recv_multipart()
                    while frames is not None:
                        msg = codec.decode(frames[-1])
                        assert isinstance(msg, EngineOutputs)
                        got.extend(t for out in msg.outputs for t in out.new_token_ids)
                        frames = readers[0].try_recv_multipart()
                    await trio.lowlevel.checkpoint()
                while len(got) < 200:
                    frames = await readers[0].recv_multipart()
                    msg = codec.decode(frames[-1])
                    assert isinstance(msg, EngineOutputs)
                    got.extend(t for out in msg.outputs for t in out.new_token_ids)
                nursery.cancel_scope.cancel()
    finally:
        for sock in (*readers, *pushes):
            sock.close()
    # Client 0 got every token, in order (folded where its reader lagged); client 1's step is held.
    assert got == list(range(200))
    assert 1 in pump._held
