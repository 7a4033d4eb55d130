"""The API server's side of the engine link: handshake, requests out, outputs in.

Sockets (design §5): the API server binds a ROUTER for requests (each engine's DEALER identity is its
engine index) and a PULL for outputs. Each socket has exactly one owner task. Other tasks hand work to
the ROUTER's owner through queues; an abort goes ahead of queued adds, so a stop-string match or a
disconnect reaches the engine without waiting behind new requests.

Rule: an abort never overtakes its own add. ``abort`` of a request whose add is still queued drops the
add (nothing of that request is ever sent); an abort for a request whose add has been sent is queued
and goes out ahead of the adds of *other* requests. The engine would ignore an abort that arrived
before its add, then run the add to ``max_tokens`` for nobody.

**Several engines** (``-dp``): the ROUTER's owner picks each add's engine when it sends it, among the
engines that are *up* (joined, not reported dead, not joining again), by the dispatch policy
(``frontend/dispatch.py``); an abort goes to the engine its add went to. Adds wait in the queue while
no engine is up. An engine that dies fails only the requests it held, while others are up; the last
one's death fails everything, and serving answers 503 until one is back.

**Who greets engines.** With one API server this client owns the handshake socket (``handshake_address``)
and answers every Hello with Welcome (``welcome``: every API server's addresses, in client-index order).
Under a supervisor (several API servers), the supervisor greets and this client binds only its ROUTER
and PULL. Either way an engine is up from its Ready on the ROUTER, which the ROUTER's owner reads
between sends. A Ready repeated by an engine already up (it says Ready again whenever a connection to
it is made: a restarted API server) changes nothing. The first Ready of an engine process this client
hears is answered with ``ClientReset``: whatever that engine holds for this client index belonged to an
API server process that died.

The output reader keeps an ``EngineHealth`` per engine (every message it receives is an observation),
and a watcher task logs when an engine stalls and when it resumes. Engines join again at any time: a
restarted engine core (launch/engine_supervisor.py), or an external one that reconnects; an engine that
replaces one whose end nobody reported (an external engine killed and started again) ends the old
one's requests first: the new engine knows none of them. ``link(index)`` is what an engine supervisor
watches of one engine; ``on_joined`` tells serving that an engine is back.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Collection, Sequence

import trio
import zmq

from trioserve.frontend.dispatch import DispatchPolicy, RequestKey
from trioserve.frontend.engine_health import EngineHealth, Stall
from trioserve.frontend.output.step_queue import StepQueue
from trioserve.frontend.replica_health import HealthEvent, OutlierRules
from trioserve.frontend.replica_pool import ReplicaPool
from trioserve.frontend.replica_roster import Roster
from trioserve.protocol.codec import ProtocolError, engine_input_codec, engine_output_codec, handshake_codec
from trioserve.protocol.messages import (
    HEARTBEAT_INTERVAL,
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    ClientAddresses,
    ClientDone,
    ClientReset,
    EngineDead,
    EngineHello,
    EngineOutputs,
    EngineReady,
    EngineRetired,
    ReplicaRoster,
    SamplingParams,
    ShutdownEngine,
    Welcome,
    engine_identity,
)
from trioserve.runtime.sync import Waker
from trioserve.transport.zmq_socket import HANDSHAKE_FAILED, TrioZmqSocket, wait_any_readable

log = logging.getLogger("trioserve.frontend")

# (reason, the requests that fail (None: every request, no engine is left), Retry-After seconds)
OnDead = Callable[[str, "list[str] | None", "int | None"], None]
# (the requests that ran past their deadline, why): serving fails them with 504
OnTimeout = Callable[["list[str]", str], None]


class EngineLinkView:
    """One engine of a client, as an engine supervisor watches it (``launch.engine_supervisor``'s
    ``EngineLink``)."""

    __slots__ = ("_client", "index")

    def __init__(self, client: EngineClient, index: int) -> None:
        self._client = client
        self.index = index

    @property
    def joins(self) -> int:
        return self._client.engine_joins.get(self.index, 0)

    @property
    def dead_report(self) -> str | None:
        return self._client.down.get(self.index)

    async def link_changed(self) -> None:
        await self._client.link_changed()

    def stall(self, now: float | None = None) -> Stall | None:
        health = self._client.health.get(self.index)
        return None if health is None else health.state(trio.current_time() if now is None else now)


class EngineClient:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        handshake_address: str | None,
        input_address: str,
        output_address: str,
        num_engines: int = 1,
        client_index: int = 0,
        output_hwm: int = 64,
        welcome: Sequence[ClientAddresses] | None = None,
        coordinator_address: str = "",
        policy: DispatchPolicy | None = None,
        ready_with_one: bool = False,
        pool: ReplicaPool | None = None,
        devices: Sequence[str] = (),
        batch_limits: tuple[int, int] | None = None,
        desired: int | None = None,
        roster_epoch: int = 0,
    ) -> None:
        """``handshake_address`` None: someone else greets engines (the supervisor); ``welcome``: the
        API servers an engine must join (default: this one); ``policy``: with several engines, which
        one takes each add (required then); ``ready_with_one``: ``run`` is started once one engine
        has joined, not all (a restarted API server serves while a dead engine is still away);
        ``pool``: deadlines and replica health (default: the seed's rules, no deployment deadline);
        ``devices``: where each replica runs, for the inventory; ``batch_limits``: the
        ``max_num_seqs`` and ``max_num_batched_tokens`` the deployment set (None: not checked);
        ``desired``: the replicas wanted now, ranks below it (None: all ``num_engines``, the ranks
        the tree is sized for; ``frontend/replica_roster.py``), as the supervisor's roster number
        ``roster_epoch`` said (0: none yet)."""
        if num_engines > 1 and policy is None:
            raise ValueError("several engines need a dispatch policy")
        self.output_hwm = output_hwm
        self._ctx = ctx
        self.handshake_address = handshake_address
        self.input_address = input_address
        self.output_address = output_address
        self.num_engines = num_engines
        self.client_index = client_index
        self.policy = policy
        self.roster = Roster(num_engines, desired)
        self.roster_epoch = roster_epoch
        self._stops: list[int] = []  # engines to send ShutdownEngine (a retiring one that overran)
        own = [ClientAddresses(input_address, output_address)]
        self._welcome = list(welcome) if welcome is not None else own
        self._coordinator_address = coordinator_address
        self.engines: dict[int, EngineReady] = {}  # the latest Ready of every engine that joined
        self.down: dict[int, str] = {}  # engines reported dead since their last join: why
        self._joining: set[int] = set()  # engines whose Hello came and whose Ready has not
        self._seen: set[tuple[int, int]] = set()  # (engine index, pid) of every Ready heard
        self.engine_joins: dict[int, int] = {}  # Readys that (re)joined, per engine
        self.bad_frames = 0
        self._adds: dict[str, bytes] = {}  # request id -> encoded add, not sent yet
        self._add_order: deque[str] = deque()  # ids in the order added (ids dropped meanwhile too)
        self._keys: dict[str, RequestKey] = {}  # request id -> its policy key, beside a queued add
        self._aborts: dict[int, list[str]] = {}  # per engine: aborts of requests whose add went there
        self._resets: list[int] = []  # engines owed a ClientReset, ahead of anything else
        self._placed: dict[str, int] = {}  # several engines: request id -> the engine its add went to
        self.dropped_adds = 0  # adds never sent: aborted while still queued
        self.health: dict[int, EngineHealth] = {}  # per engine, from its handshake on
        self.joins = 0  # Readys that (re)joined, all engines
        self.retired: set[int] = set()  # engines that said EngineRetired and have not joined since
        self.on_joined: Callable[[EngineReady], None] = lambda ready: None
        self._on_dead: OnDead = lambda reason, ids, retry_after: None
        self._ready_with_one = ready_with_one
        self.pool = pool or ReplicaPool(OutlierRules(), num_engines, client_index=client_index)
        self.pool.resize(self.roster.desired)
        self.on_timeout: OnTimeout = lambda request_ids, why: None
        self._timeouts: dict[str, float] = {}  # request id -> its deadline, beside a queued add
        self._fixed: dict[str, int] = {}  # request id -> the replica admission reserved for it
        self.devices = tuple(devices)
        self.batch_limits = batch_limits
        self.mismatched: dict[int, str] = {}  # engines whose Ready reported other batch limits: why
        self._probes: list[tuple[int, str, bytes]] = []  # (engine, probe id, encoded add), to send
        self._watch_due = math.inf  # when the exchange watcher wakes next
        self._exchange_wake = Waker()
        self._joined = trio.Event()  # every engine joined (one, with ``ready_with_one``)
        self._link_changed = Waker()
        self._wake = Waker()
        self._in_codec = engine_input_codec()
        self._out_codec = engine_output_codec()

    @property
    def queued_adds(self) -> int:
        return len(self._adds)

    @property
    def dead_report(self) -> str | None:
        """Why an engine is dead, if one is (the first such)."""
        return next(iter(self.down.values()), None)

    def link(self, index: int) -> EngineLinkView:
        return EngineLinkView(self, index)

    def up_engines(self) -> list[int]:
        """Engines that take requests now: joined, not dead, not joining again, wanted (not draining)."""
        return [i for i in self._reachable() if self.roster.wanted(i)]

    def dispatchable(self, now: float) -> list[int]:
        """The up engines a new request may go to: those the replica pool lets (not backed off or
        ejected, unless nothing else is up), and of those the healthy ones (a stalled engine, a
        silent remote one say, gets nothing new while another is healthy), else all of those."""
        up = self.up_engines()
        if self.mismatched:  # kept out of dispatch, unless no other engine is up
            up = [i for i in up if i not in self.mismatched] or up
        up = self.pool.dispatchable(up, now)
        if len(up) < 2:
            return up
        health = self.health
        healthy = [i for i in up if (h := health.get(i)) is None or h.state(now) is None]
        return healthy or up

    # ---- called from any task; never blocks -------------------------------------------------------

    def add(self, request: AddRequest, timeout_s: float | None = None, replica: int | None = None) -> None:
        """Queue ``request``; ``timeout_s``: its own deadline without output (the deployment's
        ``--request-timeout-ms`` applies anyway; the smaller wins); ``replica``: the engine it must
        go to (least-outstanding-bytes reserved it at admission), else the policy picks at send."""
        rid = request.request_id
        self._adds[rid] = self._in_codec.encode(request)
        if replica is not None:
            self._fixed[rid] = replica
        if (deadline := self.pool.deadline(timeout_s)) is not None:
            self._timeouts[rid] = deadline
        if self.policy is not None and (key := self.policy.request_key(request, self.engines)) is not None:
            self._keys[rid] = key  # the prefix policy's block hashes, computed once, here
        self._add_order.append(rid)
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests: an add still queued is dropped, the others' aborts are queued."""
        adds, timeouts, pool = self._adds, self._timeouts, self.pool
        sent = [rid for rid in request_ids if adds.pop(rid, None) is None]
        self.dropped_adds += len(request_ids) - len(sent)
        for rid in request_ids:
            timeouts.pop(rid, None)
            self._fixed.pop(rid, None)
            pool.forget(rid)
        if not sent:
            return
        if self.policy is None:
            self._aborts.setdefault(0, []).extend(sent)
        else:
            for rid in sent:
                engine = self._placed.pop(rid, None)
                if engine is not None:  # else finished, or failed with its engine
                    self.policy.done(engine)
                    self._aborts.setdefault(engine, []).append(rid)
        self._wake.set()

    def finished(self, request_id: str) -> None:
        """The engine finished this request (several engines: it no longer counts against one)."""
        engine = self._placed.pop(request_id, None)
        if engine is not None and self.policy is not None:
            self.policy.done(engine)

    def next_frame(self, up: Collection[int] = (0,), now: float = 0.0) -> tuple[int, bytes] | None:
        """What the ROUTER's owner sends next, and to which engine, given the engines ``up`` (the
        dispatchable ones) at ``now``: a ClientReset owed, else an engine's queued aborts (one
        message), else a ``ClientDone`` owed to a draining engine, else a probe (to its replica,
        dispatchable or not, if wanted), else the oldest queued add (to the engine the policy picks);
        None when nothing can be sent now."""
        if self._resets:
            engine = self._resets.pop()
            return engine, self._in_codec.encode(ClientReset(self.client_index))
        if self._stops:
            return self._stops.pop(), self._in_codec.encode(ShutdownEngine("retired"))
        if self._aborts:
            engine, ids = self._aborts.popitem()
            return engine, self._in_codec.encode(AbortRequests(ids))
        roster = self.roster
        if (done := roster.done_due(self._reachable(), set(self._fixed.values()))) is not None:
            return done, self._in_codec.encode(ClientDone(self.client_index))
        while self._probes:
            engine, _, frame = self._probes.pop()
            if engine in self.engines and engine not in self.down and roster.wanted(engine):
                return engine, frame  # else its exchange times out
        order, adds, keys = self._add_order, self._adds, self._keys
        while order and order[0] not in adds:  # dropped by an abort
            keys.pop(order.popleft(), None)
        if not order:
            return None
        policy = self.policy
        fixed = self._fixed.pop(order[0], None)
        if fixed is not None:
            engine = fixed  # reserved at admission; engine_died fails the adds fixed on a dead one
        elif policy is None:
            if 0 not in up:
                return None
            engine = 0
        elif (picked := policy.pick(up, keys.get(order[0]))) is None:
            return None
        else:
            engine = picked
        rid = order.popleft()
        add = adds.pop(rid)
        key = keys.pop(rid, None)
        if policy is not None:
            self._placed[rid] = engine
            policy.sent(engine, key)
        timeout = self._timeouts.pop(rid, None)
        self.pool.sent(rid, engine, timeout, now)
        if timeout is not None and now + timeout < self._watch_due:
            self._exchange_wake.set()
        return engine, add

    def _reachable(self) -> list[int]:
        """Engines a message can go to now: joined, not dead, not joining again."""
        return [i for i in self.engines if i not in self.down and i not in self._joining]

    def resize(self, desired: int, epoch: int) -> None:
        """The replicas wanted now are ranks below ``desired`` (the supervisor's ``ReplicaRoster``
        number ``epoch``; an older one than held is ignored): those at or past it that joined begin
        draining (no new request; ``ClientDone`` once the adds already placed there are sent)."""
        if epoch < self.roster_epoch:
            return
        self.roster_epoch = epoch
        before = self.roster.desired
        draining = self.roster.resize(desired, self.engines)
        self.pool.resize(self.roster.desired)
        if self.roster.desired != before:
            log.info(
                "replicas wanted: %d (were %d); draining: %s", self.roster.desired, before, draining or "none"
            )
        self._link_changed.set()
        self._wake.set()

    def shut_down(self, index: int) -> None:
        """Tell engine ``index`` to shut down (after its current step)."""
        self._stops.append(index)
        self._wake.set()

    def inventory(self, now: float) -> dict[str, object]:
        """``GET /v1/replicas``: the replicas as this API server sees them (each API server keeps its
        own health view; docs/replicas.md): the wanted ones, and those still draining. A replica's
        state: ``starting`` (never joined), ``failed`` (its engine is down), ``draining`` (no longer
        wanted, still up), else the health book's ``ready``, ``backoff`` or ``ejected``."""
        pool, up, roster = self.pool, self.up_engines(), self.roster
        replicas: list[dict[str, object]] = []
        for index in range(self.num_engines):
            ready = self.engines.get(index)
            if not roster.wanted(index) and (ready is None or index in self.down):
                continue  # retired, or never started
            health = pool.book.view(index, now) if index < pool.book.n_replicas else {}
            state = health.get("state", "ready")
            if ready is None:
                state = "starting"
            elif index in self.down or index in self._joining:
                state = "failed" if index in self.down else "starting"
            elif not roster.wanted(index):
                state = "draining"
            entry: dict[str, object] = {
                "index": index,
                "state": state,
                # this API server's requests there (one engine: serving counts them)
                "in_flight": pool.in_flight(index) if pool.track_all else None,
                "device": self.devices[index] if index < len(self.devices) else None,
                "restarts": max(0, self.engine_joins.get(index, 0) - 1),
                "pid": None if ready is None else ready.pid,
                "kind": None if ready is None else ready.kind,
                "max_num_seqs": None if ready is None else ready.max_num_seqs,
                "max_num_batched_tokens": None if ready is None else ready.max_num_batched_tokens or None,
                "excluded": self.mismatched.get(index),
                "max_model_len": None if ready is None else ready.max_model_len,
            }
            entry.update({k: v for k, v in health.items() if k != "state"})
            entry["timeouts_total"] = pool.timeouts_total[index] if index < pool.n else 0
            entry["requests_total"] = pool.sent_total[index] if index < pool.n else 0
            replicas.append(entry)
        return {
            "object": "list",
            "api_server": self.client_index,
            "desired": roster.desired,
            "capacity": self.num_engines,
            "ready": len(up),
            "dispatchable": len(self.dispatchable(now)),
            "data": replicas,
        }

    def stall(self, now: float | None = None) -> Stall | None:
        """A stalled engine's state when no engine that is alive is healthy (one engine: when it is
        stalled); None otherwise (``now``: trio clock, the current time if not given)."""
        if now is None:
            now = trio.current_time()
        first: Stall | None = None
        for index, health in self.health.items():
            if index in self.down:
                continue
            stall = health.state(now)
            if stall is None:
                return None
            first = first or stall
        return first

    # ---- the owner tasks -----------------------------------------------------------------------------

    async def run(
        self,
        outputs: StepQueue,
        on_dead: OnDead,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, wait for every engine's Ready (``started`` then; or the first's, with
        ``ready_with_one``), and pump until cancelled."""
        self._on_dead = on_dead
        router = TrioZmqSocket.create(self._ctx, zmq.ROUTER, bind=self.input_address)
        # Unroutable or full: raise instead of silently dropping (ROUTER's default).
        router.raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A rejoining engine's DEALER has the same identity: let it take the route over even before
        # the old connection's end is noticed.
        router.raw.setsockopt(zmq.ROUTER_HANDOVER, 1)
        pull = TrioZmqSocket.create(self._ctx, zmq.PULL, bind=self.output_address, rcvhwm=self.output_hwm)
        hs = None
        if self.handshake_address is not None:
            hs = TrioZmqSocket.create(self._ctx, zmq.ROUTER, bind=self.handshake_address)
        try:
            async with trio.open_nursery() as nursery:
                if hs is not None:
                    nursery.start_soon(self._greet, hs)
                nursery.start_soon(self._watch_health)
                nursery.start_soon(self._watch_exchanges)
                nursery.start_soon(self._router_loop, router)
                await self._joined.wait()
                nursery.start_soon(self._recv_loop, pull, outputs)
                task_status.started()
        finally:
            if self.handshake_address is not None:  # the engines' owner (else the supervisor's)
                goodbye = self._in_codec.encode(ShutdownEngine("api server exit"))
                for index in self.engines:
                    with contextlib.suppress(zmq.ZMQError):  # the engine may be gone already
                        router.try_send_multipart([engine_identity(index), goodbye])
            if hs is not None:
                hs.close()
            router.close()
            pull.close()

    async def link_changed(self) -> None:
        """Returns after ``joins`` or an engine's death report changed (perhaps before this call)."""
        await self._link_changed.wait()

    def engine_died(self, index: int, reason: str, retry_after: int | None = None) -> None:
        """Engine ``index`` is gone (the link said so, its process exited, or the supervisor said so):
        until it joins again its silence is no stall, nothing is sent to it, and the requests it held
        fail (all requests, when no engine is left up)."""
        if index in self.down:
            if retry_after is not None and not self.up_engines():
                self._on_dead(self.down[index], None, retry_after)  # a better Retry-After
            return
        self.down[index] = reason
        if not self.roster.wanted(index):
            self.roster.retired(index)  # a draining engine that died: it is owed nothing more
        self.pool.engine_failed(index, trio.current_time())
        self._log_health()
        health = self.health.get(index)
        if health is not None:
            health.pause()
        self._aborts.pop(index, None)
        self._link_changed.set()
        lost: list[str] | None = [rid for rid, e in self._placed.items() if e == index]
        assert lost is not None
        for rid in lost:
            del self._placed[rid]
            if self.policy is not None:
                self.policy.done(index)
        queued = [rid for rid, e in self._fixed.items() if e == index]  # reserved there, not sent
        for rid in queued:
            del self._fixed[rid]
            self._adds.pop(rid, None)
            self._timeouts.pop(rid, None)
        lost += queued
        if self.policy is None or not self.up_engines():
            lost = None  # nothing is left: every request fails, and new ones are refused
        self._on_dead(reason, lost, retry_after)

    async def _greet(self, hs: TrioZmqSocket) -> None:
        """Owns the handshake socket: every engine's Hello, the first or a later one, gets Welcome and
        marks that engine as joining (nothing is sent to it until its Ready)."""
        codec = handshake_codec()
        welcome = codec.encode(Welcome(self._welcome, coordinator_address=self._coordinator_address))
        monitor = None
        if self.handshake_address is not None and self.handshake_address.startswith("tcp://"):
            monitor = hs.monitor(HANDSHAKE_FAILED)
        refused = 0
        while True:
            frames = hs.try_recv_multipart()
            if frames is None:
                if monitor is None:
                    frames = await hs.recv_multipart()
                elif monitor.try_recv_multipart() is not None:
                    refused += 1
                    if refused == 1 or refused % 100 == 0:  # a peer retries every 100 ms
                        log.warning(
                            "handshake: %d connections to %s failed their CURVE handshake (an engine "
                            "with another --engine-secret, or not an engine)",
                            refused,
                            self.handshake_address,
                        )
                    continue
                else:
                    await wait_any_readable(hs, monitor)
                    continue
            peer, frame = frames[-2:]
            try:
                hello = codec.decode(frame)
            except ProtocolError as exc:
                log.warning("handshake: %s", exc)
                continue
            if not isinstance(hello, EngineHello) or hello.protocol_version != PROTOCOL_VERSION:
                log.warning("handshake: unexpected %r", hello)
                continue
            if hello.engine_index >= self.num_engines:
                log.warning("handshake: engine %d, but there are %d", hello.engine_index, self.num_engines)
                continue
            if self.engine_joins.get(hello.engine_index):
                log.info("engine %d (pid %d) joins again", hello.engine_index, hello.pid)
            self._joining.add(hello.engine_index)  # before Welcome: its Ready comes after it
            await hs.send_multipart([peer, welcome])

    async def _router_loop(self, router: TrioZmqSocket) -> None:
        """Owns the request ROUTER: reads every Ready that arrives, and sends what ``next_frame``
        gives; parks on the socket or the wake-up, whichever comes first."""
        codec = handshake_codec()
        while True:
            while (frames := router.try_recv_multipart()) is not None:
                try:
                    ready = codec.decode(frames[-1])
                except ProtocolError as exc:
                    log.warning("handshake: %s", exc)
                    continue
                if isinstance(ready, EngineReady):
                    self._on_ready(ready)
            now = trio.current_time()
            item = self.next_frame(self.dispatchable(now), now)
            if item is None:
                await self._wake.wait_or(router.wait_readable)
                continue
            index, frame = item
            try:
                await router.send_multipart([engine_identity(index), frame])
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the engine's socket is gone
                self.engine_died(index, f"cannot reach engine {index}: {exc}")

    def _on_ready(self, ready: EngineReady) -> None:
        index = ready.engine_index
        if index >= self.num_engines:
            log.warning("engine %d said Ready, but there are %d", index, self.num_engines)
            return
        known = self.engines.get(index)
        if known is not None and index not in self.down:
            if known.pid == ready.pid and index not in self._joining:
                return  # said again after a connection was made (a restarted API server's): no news
            if known.pid != ready.pid:
                gone = f"engine {index} (pid {known.pid})"
                self.engine_died(index, f"{gone} was replaced by pid {ready.pid} before reporting its end")
        self.engines[index] = ready
        self._check_limits(ready)
        self.down.pop(index, None)
        self._joining.discard(index)
        if (index, ready.pid) not in self._seen:
            self._seen.add((index, ready.pid))
            self._resets.append(index)
        old = self.health.get(index)
        fresh = self.health[index] = EngineHealth(index, trio.current_time())
        if old is not None:
            fresh.stall_count = old.stall_count  # a counter in /metrics: it never goes back
        self.engine_joins[index] = self.engine_joins.get(index, 0) + 1
        self.joins += 1
        log.info("engine %d ready (%s, pid %d)", index, ready.kind, ready.pid)
        self.retired.discard(index)
        self.roster.joined(index)  # a draining engine that joins again is owed ClientDone again
        self._link_changed.set()
        if self._ready_with_one or sum(map(self.roster.wanted, self.engines)) >= self.roster.desired:
            self._joined.set()
        self.on_joined(ready)

    def _check_limits(self, ready: EngineReady) -> None:
        """An engine whose batch limits differ from the deployment's (an external engine started
        with other flags, say) serves differently from its peers: it is kept out of dispatch while
        others are up, and the inventory says why."""
        index, limits = ready.engine_index, self.batch_limits
        self.mismatched.pop(index, None)
        if limits is None or self.num_engines == 1:
            return
        seqs, tokens = limits
        wrong = []
        if ready.max_num_seqs != seqs:
            wrong.append(f"max_num_seqs {ready.max_num_seqs}, not {seqs}")
        if ready.max_num_batched_tokens and ready.max_num_batched_tokens != tokens:
            wrong.append(f"max_num_batched_tokens {ready.max_num_batched_tokens}, not {tokens}")
        if wrong:
            why = "reported " + " and ".join(wrong)
            self.mismatched[index] = why
            log.error("engine %d %s: kept out of dispatch while another engine is up", index, why)

    async def _recv_loop(self, pull: TrioZmqSocket, outputs: StepQueue) -> None:
        several = self.policy is not None
        pool = self.pool
        while True:
            (frame,) = (await pull.recv_multipart())[-1:]
            try:
                msg = self._out_codec.decode(frame)
            except ProtocolError as exc:
                self.bad_frames += 1
                log.warning("dropping engine frame: %s", exc)
                continue
            match msg:
                case EngineOutputs():
                    health = self.health.get(msg.engine_index)
                    # One engine without deadlines tracks nothing here (the per-token path).
                    if msg.outputs and (several or pool.exchanges):
                        now = trio.current_time()
                        for out in msg.outputs:
                            done = out.finish_reason is not None
                            if several and done:
                                self.finished(out.request_id)
                            pool.output(out.request_id, done, now)  # deadlines, answers (replica_pool)
                        if pool.events:
                            self._log_health()
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
                case EngineDead(engine_index=index, reason=reason, pid=pid):
                    known = self.engines.get(index)
                    if pid and known is not None and known.pid != pid:
                        continue  # about a process that was replaced already
                    if known is None and not self.roster.wanted(index):
                        continue  # retired already
                    self.engine_died(index, f"engine {index} failed: {reason}")
                case EngineRetired(engine_index=index):
                    self._retired(index)
                case ReplicaRoster(desired=desired, epoch=epoch):
                    self.resize(desired, epoch)

    def _retired(self, index: int) -> None:
        """Engine ``index`` retired (every client was done with it, and it held nothing): it is gone
        without a failure, and no longer shown."""
        if index not in self.engines:
            return
        if any(engine == index for engine in self._placed.values()):  # cannot be: it said it was idle
            self.engine_died(index, f"engine {index} retired while requests were placed there")
        for book in (self.engines, self.down, self.health, self.mismatched, self.engine_joins):
            book.pop(index, None)
        self._joining.discard(index)
        self.roster.retired(index)
        self.retired.add(index)
        log.info("engine %d retired (a resize)", index)
        self._link_changed.set()

    async def _watch_exchanges(self) -> None:
        """The replica pool's clock: ends the exchanges past their deadline (504 through
        ``on_timeout``, an abort to the engine), ends backoffs and cool-downs, sends the probes the
        health book asks for, and logs its events."""
        pool = self.pool
        while True:
            now = trio.current_time()
            expired = pool.overdue(now, pool.up_flags(self.up_engines()))
            late: dict[int, list[str]] = {}
            for rid, replica, probe in expired:
                if probe:
                    self._aborts.setdefault(replica, []).append(rid)
                else:
                    late.setdefault(replica, []).append(rid)
            for replica, ids in late.items():
                why = f"replica {replica} gave no output within the request's deadline"
                self.on_timeout(ids, why)  # each response's end aborts its engine requests
            for rid, replica in pool.take_probes(now):
                add = AddRequest(rid, [0], SamplingParams(max_tokens=1), 0.0, self.client_index)
                self._probes.append((replica, rid, self._in_codec.encode(add)))
            if expired or self._probes:
                self._wake.set()
            self._log_health()
            due = pool.next_wake(now)
            self._watch_due = math.inf if due is None else due
            with trio.move_on_at(self._watch_due):
                await self._exchange_wake.wait()

    def _log_health(self) -> None:
        """Log the replica pool's events, and clear its outbox."""
        events = self.pool.events
        for event in events:
            _log_event(event)
        events.clear()

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


def _log_event(event: HealthEvent) -> None:
    """One health event as the seed names it: ``replica_ejected``, ``replica_readmitted``,
    ``replica_ejection_withheld`` (with the rule that held it back); backoffs at debug level."""
    fields = f"replica={event.replica} reason={event.reason}"
    if event.duration is not None:
        fields += f" duration_s={event.duration:g}"
    if event.kind == "replica_backoff":
        log.debug("%s %s", event.kind, fields)
    elif event.kind == "replica_readmitted":
        log.info("%s %s", event.kind, fields)
    else:
        log.warning("%s %s", event.kind, fields)


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
