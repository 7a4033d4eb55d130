"""Engine → API servers: one PUSH socket per client index, with the ``--engine-output-policy``.

- ``fold`` (default): the busy loop hands each step over and never waits; this pump, the sockets'
  only owner (a ZMQ FD is edge-triggered: two tasks on one socket lose wakeups), sends it as soon as
  the socket takes it. Until then later steps are folded into the held one, per request.
- ``block``: the busy loop sends itself and waits while a socket is at its high-water mark, so a slow
  API server slows the engine.
"""

from __future__ import annotations

from typing import Literal

import trio

from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.fold import fold_outputs
from trioserve.protocol.messages import EngineDead, EngineOutputs
from trioserve.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket

OutputPolicy = Literal["fold", "block"]


class OutputPump:
    def __init__(self, sockets: list[TrioZmqSocket], policy: OutputPolicy) -> None:
        self._sockets = sockets
        self.policy = policy
        self._codec = engine_output_codec()
        self._held: dict[int, EngineOutputs] = {}  # client -> the step its socket has not taken yet
        self._wake = Waker()
        self.folded_steps = 0
        self._drained: trio.Event | None = None

    async def send(self, client: int, step: EngineOutputs) -> None:
        """Called by the busy loop once per step per client."""
        if self.policy == "block":
            await self._sockets[client].send_multipart([self._codec.encode(step)])
            return
        held = self._held.get(client)
        if held is not None:
            fold_outputs(held, step)
            self.folded_steps += 1
        else:
            self._held[client] = step
            self._wake.set()

    async def send_dead(self, dead: EngineDead, timeout: float = 2.0) -> None:
        """The last message to every API server: what is held goes first, then ``dead``. Gives up
        after ``timeout`` seconds (an API server that reads nothing more would keep us forever)."""
        with trio.move_on_after(timeout):
            if self.policy == "fold" and self._held:
                self._drained = trio.Event()  # the sender task sets it once nothing is held
                await self._drained.wait()
            frame = self._codec.encode(dead)
            for sock in self._sockets:
                await sock.send_multipart([frame])

    async def run(self) -> None:
        """The sender task of the ``fold`` policy."""
        while True:
            if not self._held:
                await self._wake.wait()
                continue
            for client in list(self._held):
                sock = self._sockets[client]
                # Take, encode and send with no await in between: the busy loop folds into the held
                # step until this very moment, and nothing can overtake it.
                held = self._held.pop(client)
                if not sock.try_send_multipart([self._codec.encode(held)]):
                    self._held[client] = held
                    await sock.wait_writable()
            if not self._held and self._drained is not None:
                self._drained.set()
