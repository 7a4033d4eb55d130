"""Engine → API servers: one PUSH socket per client index, with the ``--engine-output-policy``.

- ``fold`` (default): the busy loop hands each step over and never waits; this pump, the sockets'
  only owner (a ZMQ FD is edge-triggered: two tasks on one socket lose wakeups), sends it as soon as
  the socket takes it. Until then later steps are folded into the held one, per request.
- ``block``: the busy loop sends itself and waits while a socket is at its high-water mark, so a slow
  API server slows the engine.

Besides step outputs the busy loop sends stats-only messages (``send_stats``): the idle report and the
heartbeat, on the rules of ``Heartbeat``. Every message that leaves carries the pump's fold count in
its stats (``EngineStats.folded_steps``), so API servers can export it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import trio

from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.fold import fold_outputs
from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineDead, EngineOutputs
from trioserve.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket

OutputPolicy = Literal["fold", "block"]


class Heartbeat:
    """Which API servers (client indexes) an engine owes a stats-only message, and when. Pure: the
    caller passes the time (its trio clock) and whether the engine has work.

    Rules:

    - **idle report**: once the engine has no work after having had some (the step in which its last
      request finished, or the abort of its last request), every client that got no message since
      the previous check gets one, so its gauges and admission read the idle stats at once instead
      of the last busy step's counts (a client that did get one already has the stats of that step);
    - **heartbeat**: a client that got no message for ``interval`` seconds gets one, busy or idle.
      Idle, that is one per interval per client; busy, only a client with nothing running hears it
      (its requests may all be waiting).

    Only the busy loop sends them, between steps: a message proves that the loop still steps. A
    hung forward or a stopped process goes silent, and the API server's ``EngineHealth`` sees it.
    """

    __slots__ = ("_fresh", "_had_work", "_last_sent", "interval")

    def __init__(self, num_clients: int, interval: float = HEARTBEAT_INTERVAL) -> None:
        self.interval = interval
        self._last_sent = [-math.inf] * num_clients  # so the first check greets every client
        self._fresh: set[int] = set()  # clients sent a message since the last ``owed``
        self._had_work = False

    def sent(self, client: int, now: float) -> None:
        self._last_sent[client] = now
        self._fresh.add(client)

    def owed(self, now: float, has_work: bool) -> list[int]:
        """The clients owed a stats-only message now (the caller sends them, calling ``sent``)."""
        went_idle = self._had_work and not has_work
        self._had_work = has_work
        interval = self.interval
        owed = [
            client
            for client, last in enumerate(self._last_sent)
            # ``last + interval`` exactly as ``next_due`` computes it: a loop woken at that instant
            # must find the heartbeat owed (``now - last`` can round below ``interval``).
            if (went_idle and client not in self._fresh) or now >= last + interval
        ]
        self._fresh.clear()
        return owed

    def next_due(self) -> float:
        """When the next heartbeat is owed, if nothing is sent meanwhile (an idle loop sleeps until
        then)."""
        return min(self._last_sent, default=math.inf) + self.interval


class OutputPump:
    def __init__(
        self,
        sockets: list[TrioZmqSocket],
        policy: OutputPolicy,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
    ) -> None:
        self._sockets = sockets
        self.policy = policy
        self._codec = engine_output_codec()
        self._held: dict[int, EngineOutputs] = {}  # client -> the step its socket has not taken yet
        self._wake = Waker()
        self.folded_steps = 0  # steps with outputs folded into a held one (stats-only ones not counted)
        self._drained: trio.Event | None = None
        self.heartbeat = Heartbeat(len(sockets), heartbeat_interval)

    async def send(self, client: int, step: EngineOutputs) -> None:
        """Called by the busy loop once per step per client."""
        self.heartbeat.sent(client, trio.current_time())
        if self.policy == "block":
            step.stats.folded_steps = self.folded_steps
            await self._sockets[client].send_multipart([self._codec.encode(step)])
            return
        held = self._held.get(client)
        if held is not None:
            fold_outputs(held, step)
            if step.outputs:
                self.folded_steps += 1
        else:
            self._held[client] = step
            self._wake.set()

    async def send_stats(self, has_work: bool, message: Callable[[], EngineOutputs]) -> None:
        """Send the stats-only messages ``Heartbeat`` says are owed now; ``message`` builds one (a
        fresh struct per client: a held message is folded into in place)."""
        for client in self.heartbeat.owed(trio.current_time(), has_work):
            await self.send(client, message())

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
                held.stats.folded_steps = self.folded_steps
                if not sock.try_send_multipart([self._codec.encode(held)]):
                    self._held[client] = held
                    await sock.wait_writable()
            if not self._held and self._drained is not None:
                self._drained.set()
