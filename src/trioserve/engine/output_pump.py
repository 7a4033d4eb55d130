"""Engine → API servers: one PUSH socket per client index, with the ``--engine-output-policy``.

- ``fold`` (default): the busy loop hands each step over and never waits; this pump, the sockets'
  only owner (a ZMQ FD is edge-triggered: two tasks on one socket lose wakeups), sends it as soon as
  the socket takes it. Until then later steps are folded into the held one, per request.
- ``block``: the busy loop sends itself and waits while a socket is at its high-water mark, so a slow
  API server slows the engine.

Besides step outputs the engine sends stats-only messages, on the rules of ``Heartbeat``: the busy loop
between steps (``send_stats``: the idle report and the heartbeat), and the engine core's beat task
while a step runs (``beat``: the heartbeat, and the news that the step is overdue). Every message that
leaves carries the pump's fold count in its stats (``EngineStats.folded_steps``), so API servers can
export it.

Rule for ``beat`` (one owner task per socket, design §5): it never awaits. Under ``fold`` it only holds
(or folds into) the client's message and wakes the sender task, which stays the sockets' only user.
Under ``block`` the busy loop owns the sockets, and ``beat`` is called only while the busy loop awaits
the executor, so nobody waits on a socket meanwhile; it then makes one non-blocking try-send, never a
wait on the FD (the edge a waiter needs cannot be taken from it), and a full socket just skips that
heartbeat (an API server that has not read what is queued does not miss one).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

import trio

from trioserve.protocol.codec import engine_output_codec
from trioserve.protocol.fold import fold_outputs
from trioserve.protocol.messages import HEARTBEAT_INTERVAL, EngineDead, EngineOutputs, EngineRetired
from trioserve.runtime.sync import Waker
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

    They are owed during a step too (the engine core's beat task sends them, ``OutputPump.beat``):
    a message proves that the engine core process runs, even while one forward takes seconds. A
    stopped process goes silent, and the API server's ``EngineHealth`` sees it; a forward that hangs
    is told by the step's own stats (``EngineStats.step_overdue``, ``engine/step_watch.py``).

    A stats-only message the caller sends because it is owed is recorded with ``beat``, not ``sent``:
    it does not count as fresh for the idle report (its stats may be older than the step that
    follows, e.g. a heartbeat in the middle of the step in which the last request finishes).
    """

    __slots__ = ("_fresh", "_had_work", "_last_sent", "interval")

    def __init__(self, num_clients: int, interval: float = HEARTBEAT_INTERVAL) -> None:
        self.interval = interval
        self._last_sent = [-math.inf] * num_clients  # so the first check greets every client
        self._fresh: set[int] = set()  # clients sent a message since the last ``owed``
        self._had_work = False

    def sent(self, client: int, now: float) -> None:
        """A step's outputs went to ``client``."""
        self._last_sent[client] = now
        self._fresh.add(client)

    def beat(self, client: int, now: float) -> None:
        """A stats-only message went to ``client`` (or was skipped at a full socket): the next one is
        due an interval later."""
        self._last_sent[client] = now

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

    @property
    def num_clients(self) -> int:
        return len(self._sockets)

    async def send(self, client: int, step: EngineOutputs) -> None:
        """Called by the busy loop once per step per client."""
        self.heartbeat.sent(client, trio.current_time())
        await self._deliver(client, step)

    async def _deliver(self, client: int, step: EngineOutputs) -> None:
        if self.policy == "block":
            step.stats.folded_steps = self.folded_steps
            await self._sockets[client].send_multipart([self._codec.encode(step)])
            return
        self._hold(client, step)

    def _hold(self, client: int, step: EngineOutputs) -> None:
        held = self._held.get(client)
        if held is not None:
            fold_outputs(held, step)
            if step.outputs:
                self.folded_steps += 1
        else:
            self._held[client] = step
            self._wake.set()

    async def send_stats(
        self, has_work: bool, message: Callable[[], EngineOutputs], also: Iterable[int] = ()
    ) -> None:
        """Send the stats-only messages ``Heartbeat`` says are owed now, and one to each client in
        ``also`` (news); ``message`` builds one (a fresh struct per client: a held message is folded
        into in place)."""
        now = trio.current_time()
        owed = self.heartbeat.owed(now, has_work)
        for client in sorted({*owed, *also}) if also else owed:
            self.heartbeat.beat(client, now)
            await self._deliver(client, message())

    def beat(self, message: Callable[[], EngineOutputs], *, everyone: bool = False) -> None:
        """While a step runs: send the heartbeats owed now (to every client with ``everyone``: news
        that must not wait for the next one). Never awaits; see the module docstring for why this
        keeps every socket with one owner."""
        now = trio.current_time()
        heartbeat = self.heartbeat
        clients = range(len(self._sockets)) if everyone else heartbeat.owed(now, has_work=True)
        for client in clients:
            heartbeat.beat(client, now)
            msg = message()
            if self.policy == "fold":
                self._hold(client, msg)
                continue
            msg.stats.folded_steps = self.folded_steps
            self._sockets[client].try_send_multipart([self._codec.encode(msg)])  # full: skipped

    async def send_last(self, last: EngineDead | EngineRetired, timeout: float = 2.0) -> None:
        """The last message to every API server: what is held goes first, then ``last``. Gives up
        after ``timeout`` seconds (an API server that reads nothing more would keep us forever)."""
        with trio.move_on_after(timeout):
            if self.policy == "fold" and self._held:
                self._drained = trio.Event()  # the sender task sets it once nothing is held
                await self._drained.wait()
            frame = self._codec.encode(last)
            for sock in self._sockets:
                await sock.send_multipart([frame])

    async def run(self) -> None:
        """The sender task of the ``fold`` policy. Rule: a client whose socket is full (its API server
        is slow, or dead and being restarted: ZMQ queues for it up to the high-water mark) never holds
        up the others; its step stays held (and folds) while the rest go out, and the task waits for
        any full socket to drain or for a new step to hold."""
        while True:
            if not self._held:
                if self._drained is not None:
                    self._drained.set()
                await self._wake.wait()
                continue
            full: list[TrioZmqSocket] = []
            for client in list(self._held):
                sock = self._sockets[client]
                # Take, encode and send with no await in between: the busy loop folds into the held
                # step until this very moment, and nothing can overtake it.
                held = self._held.pop(client)
                held.stats.folded_steps = self.folded_steps
                if not sock.try_send_multipart([self._codec.encode(held)]):
                    self._held[client] = held
                    full.append(sock)
            if full:
                await _until_writable_or(full, self._wake)


async def _until_writable_or(sockets: list[TrioZmqSocket], wake: Waker) -> None:
    """Returns once one of ``sockets`` can take a message, or ``wake`` is set (one waiter per socket:
    the pump owns them all)."""
    async with trio.open_nursery() as nursery:

        async def first(wait: Callable[[], Awaitable[object]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(first, wake.wait)
        for sock in sockets:
            nursery.start_soon(first, sock.wait_writable)
