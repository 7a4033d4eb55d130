"""The API server's side of the engine link: handshake, requests out, outputs in.

Sockets (design §5): the API server binds a ROUTER for requests (each engine's DEALER identity is its
engine index) and a PULL for outputs; engines join through a handshake ROUTER. Each socket has exactly
one owner task. Other tasks hand work to the sender through two queues; ``abort`` goes ahead of queued
``add``s, so a stop-string match or a disconnect reaches the engine without waiting behind new requests.

Rule: an abort never overtakes its own add. ``abort`` of a request whose add is still queued drops the
add (nothing of that request is ever sent); an abort for a request whose add has been sent is queued
and goes out ahead of the adds of *other* requests. The engine would ignore an abort that arrived
before its add, then run the add to ``max_tokens`` for nobody.

The output reader also keeps an ``EngineHealth`` per engine (every message it receives is an
observation), and a watcher task logs when an engine stalls and when it resumes.

Engines join again at any time: a restarted engine core (launch/engine_supervisor.py), or an external
one that reconnects. The handshake socket stays bound for the client's whole life and its owner task
(``_greet``) answers every Hello with Welcome. Rule: a Hello pauses the pumps (the sender and the output
reader are cancelled) until that engine says Ready on the request ROUTER, which ``_await_ready`` reads
while the sender is stopped, so the ROUTER keeps one owner at a time. The ROUTER and the PULL stay
bound throughout; ``ROUTER_HANDOVER`` lets the new engine's DEALER, which has the old one's identity,
take the route over. ``joins``, ``dead_report`` and ``link_changed`` are what the engine supervisor
watches; ``on_joined`` tells serving that the engine is back.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable

import trio
import zmq

from trioserve.frontend.engine_health import EngineHealth, Stall
from trioserve.frontend.output.step_queue import StepQueue
from trioserve.protocol.codec import ProtocolError, engine_input_codec, engine_output_codec, handshake_codec
from trioserve.protocol.messages import (
    HEARTBEAT_INTERVAL,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    ClientAddresses,
    EngineDead,
    EngineHello,
    EngineOutputs,
    EngineReady,
    ShutdownEngine,
    Welcome,
    engine_identity,
)
from trioserve.runtime.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve.frontend")


class EngineClient:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        handshake_address: str,
        input_address: str,
        output_address: str,
        num_engines: int = 1,
        client_index: int = 0,
        output_hwm: int = 64,
    ) -> None:
        self.output_hwm = output_hwm
        self._ctx = ctx
        self.handshake_address = handshake_address
        self.input_address = input_address
        self.output_address = output_address
        self.num_engines = num_engines
        self.client_index = client_index
        self.engines: dict[int, EngineReady] = {}
        self.bad_frames = 0
        self._adds: dict[str, bytes] = {}  # request id -> encoded add, not sent yet
        self._add_order: deque[str] = deque()  # ids in the order added (ids dropped meanwhile too)
        self._aborts: list[str] = []  # aborts of requests whose add has been sent
        self.dropped_adds = 0  # adds never sent: aborted while still queued
        self.health: dict[int, EngineHealth] = {}  # per engine, from its handshake on
        # The link as the engine supervisor sees it: handshakes completed, and why the engine is dead
        # if the link said so (EngineDead, unreachable) since the last handshake.
        self.joins = 0
        self.dead_report: str | None = None
        self.on_joined: Callable[[EngineReady], None] = lambda ready: None
        self._link_changed = Waker()
        self._joining: dict[int, int] = {}  # engine index -> pid of its latest Hello, until its Ready
        self._hello = Waker()
        self._wake = Waker()
        self._in_codec = engine_input_codec()
        self._out_codec = engine_output_codec()

    @property
    def queued_adds(self) -> int:
        return len(self._adds)

    # ---- called from any task; never blocks -------------------------------------------------------

    def add(self, request: AddRequest) -> None:
        rid = request.request_id
        self._adds[rid] = self._in_codec.encode(request)
        self._add_order.append(rid)
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests: an add still queued is dropped, the others' aborts are queued."""
        adds = self._adds
        sent = [rid for rid in request_ids if adds.pop(rid, None) is None]
        self.dropped_adds += len(request_ids) - len(sent)
        if sent:
            self._aborts += sent
            self._wake.set()

    def next_frame(self) -> bytes | None:
        """What the sender sends next: the queued aborts (one message), else the oldest queued add;
        None when nothing is queued."""
        if self._aborts:
            frame = self._in_codec.encode(AbortRequests(self._aborts))
            self._aborts = []
            return frame
        order, adds = self._add_order, self._adds
        while order:
            add = adds.pop(order.popleft(), None)
            if add is not None:  # else dropped by an abort
                return add
        return None

    def stall(self, now: float | None = None) -> Stall | None:
        """The first stalled engine's state (None while every engine talks; ``now``: trio clock, the
        current time if not given)."""
        if now is None:
            now = trio.current_time()
        for health in self.health.values():
            stall = health.state(now)
            if stall is not None:
                return stall
        return None

    # ---- the owner tasks -----------------------------------------------------------------------------

    async def run(
        self,
        outputs: StepQueue,
        on_dead: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, wait for every engine's handshake (``started`` after the first), then pump until
        cancelled, pausing the pumps while an engine joins again (see the module docstring)."""
        router = TrioZmqSocket.create(self._ctx, zmq.ROUTER, bind=self.input_address)
        # Unroutable or full: raise instead of silently dropping (ROUTER's default).
        router.raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A rejoining engine's DEALER has the same identity: let it take the route over even before
        # the old connection's end is noticed.
        router.raw.setsockopt(zmq.ROUTER_HANDOVER, 1)
        pull = TrioZmqSocket.create(self._ctx, zmq.PULL, bind=self.output_address, rcvhwm=self.output_hwm)
        hs = TrioZmqSocket.create(self._ctx, zmq.ROUTER, bind=self.handshake_address)

        def dead(reason: str) -> None:
            self.mark_dead(reason)
            on_dead(reason)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._greet, hs)
                nursery.start_soon(self._watch_health)
                first = True
                while True:
                    joined = await self._await_ready(router, dead)
                    if first:
                        task_status.started()
                        first = False
                    for ready in joined:
                        self.on_joined(ready)
                    async with trio.open_nursery() as pumps:
                        pumps.start_soon(self._send_loop, router, dead)
                        pumps.start_soon(self._recv_loop, pull, outputs, dead)
                        while not self._joining:
                            await self._hello.wait()
                        pumps.cancel_scope.cancel()
        finally:
            goodbye = self._in_codec.encode(ShutdownEngine("api server exit"))
            for index in self.engines:
                with contextlib.suppress(zmq.ZMQError):  # the engine may be gone already
                    router.try_send_multipart([engine_identity(index), goodbye])
            hs.close()
            router.close()
            pull.close()

    async def link_changed(self) -> None:
        """Returns after ``joins`` or ``dead_report`` changed (perhaps before this call)."""
        await self._link_changed.wait()

    def mark_dead(self, reason: str) -> None:
        """The engine is dead (the link said so, or its process exited): until an engine joins
        again its silence is no stall, and ``dead_report`` says why."""
        for health in self.health.values():
            health.pause()
        self.dead_report = reason
        self._link_changed.set()

    async def _greet(self, hs: TrioZmqSocket) -> None:
        """Owns the handshake socket: every engine's Hello, the first or a later one, gets Welcome
        and marks that engine as joining (the run loop pauses the pumps for it)."""
        codec = handshake_codec()
        welcome = codec.encode(Welcome([ClientAddresses(self.input_address, self.output_address)]))
        while True:
            peer, frame = (await hs.recv_multipart())[-2:]
            try:
                hello = codec.decode(frame)
            except ProtocolError as exc:
                log.warning("handshake: %s", exc)
                continue
            if not isinstance(hello, EngineHello) or hello.protocol_version != PROTOCOL_VERSION:
                log.warning("handshake: unexpected %r", hello)
                continue
            if self.joins:
                log.info("engine %d (pid %d) joins again", hello.engine_index, hello.pid)
            self._joining[hello.engine_index] = hello.pid  # before Welcome: its Ready comes after it
            self._hello.set()
            await hs.send_multipart([peer, welcome])

    async def _await_ready(self, router: TrioZmqSocket, dead: Callable[[str], None]) -> list[EngineReady]:
        """Owns the request ROUTER (the sender is stopped) until every engine is known and every
        joining one has said Ready; returns the Readys it read. An engine that replaces one whose
        end nobody reported (an external engine killed and started again) ends the old one's
        requests first: the new engine knows none of them, so they would wait forever."""
        codec = handshake_codec()
        joined: list[EngineReady] = []
        while len(self.engines) < self.num_engines or self._joining:
            frame = (await router.recv_multipart())[-1]
            try:
                ready = codec.decode(frame)
            except ProtocolError as exc:
                log.warning("handshake: %s", exc)
                continue
            if not isinstance(ready, EngineReady):
                continue
            index = ready.engine_index
            replaced = self.engines.get(index)
            if replaced is not None and replaced.pid != ready.pid and self.dead_report is None:
                gone = f"engine {index} (pid {replaced.pid})"
                dead(f"{gone} was replaced by pid {ready.pid} before reporting its end")
            self.engines[index] = ready
            if self._joining.get(index) == ready.pid:  # else an engine superseded by a later Hello
                del self._joining[index]
            joined.append(ready)
            log.info("engine %d ready (%s, pid %d)", index, ready.kind, ready.pid)
        now = trio.current_time()
        for ready in joined:
            old = self.health.get(ready.engine_index)
            fresh = self.health[ready.engine_index] = EngineHealth(ready.engine_index, now)
            if old is not None:
                fresh.stall_count = old.stall_count  # a counter in /metrics: it never goes back
        self.joins += len(joined)
        self.dead_report = None
        self._link_changed.set()
        return joined

    async def _send_loop(self, router: TrioZmqSocket, on_dead: Callable[[str], None]) -> None:
        identity = engine_identity(0)  # one engine per API server until data parallelism lands
        while True:
            frame = self.next_frame()
            if frame is None:
                await self._wake.wait()
                continue
            try:
                await router.send_multipart([identity, frame])
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the engine's socket is gone
                on_dead(f"cannot reach engine 0: {exc}")

    async def _recv_loop(
        self,
        pull: TrioZmqSocket,
        outputs: StepQueue,
        on_dead: Callable[[str], None],
    ) -> None:
        while True:
            (frame,) = (await pull.recv_multipart())[-1:]
            try:
                msg = self._out_codec.decode(frame)
            except ProtocolError as exc:
                self.bad_frames += 1
                log.warning("dropping engine frame: %s", exc)
                continue
            health = self.health.get(msg.engine_index)
            match msg:
                case EngineOutputs():
                    if health is None:
                        await outputs.put(msg)
                        continue
                    now = trio.current_time()
                    health.observe(now, msg.stats)
                    if health.stalled_since is not None or health.overdue:  # a stall ends or begins
                        _log_transition(health, now)
                    health.pause()  # a full queue under "block": the wait is ours, not the engine's
                    await outputs.put(msg)
                    health.resume(trio.current_time())
                case EngineDead(engine_index=index, reason=reason):
                    on_dead(f"engine {index} failed: {reason}")

    async def _watch_health(self) -> None:
        """Log when an engine stalls (its resumption is logged by the reader, on the message that
        ends it). ``/health`` and admission read the state themselves; this only logs and counts."""
        while True:
            now = trio.current_time()
            due = now + HEARTBEAT_INTERVAL  # a message moves a deadline later, a smaller bound earlier
            for health in self.health.values():
                _log_transition(health, now)
                if health.stalled_since is None:
                    due = min(due, health.deadline())
            await trio.sleep_until(due)


def _log_transition(health: EngineHealth, now: float) -> None:
    match health.update(now):
        case ("stalled", stall):
            log.error(
                "engine %d stalled: %s; /health answers 503 and new requests are refused until it resumes",
                health.engine_index,
                stall.reason,
            )
        case ("resumed", duration):
            log.warning("engine %d resumed after %.1f s stalled", health.engine_index, duration)
