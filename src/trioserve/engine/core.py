"""The engine-core process's Trio shell (design §3, §7): one shell around a small core interface
(``engine/core_api.py``), run the same way whether the core is the scheduler with its executor
(``engine/scheduler_core.py``) or the mock (``mock/core.py``).

Tasks, all in one nursery: an input pump per API server (decodes requests and hands them to the core,
which builds its ``Request``s and hashes their prompt blocks between steps, so the step itself never
does), the busy loop (``schedule`` → ``execute`` → ``update``) with its beat task beside it, and the
output pump.

Aborts take a fast path: the input pump hands each one to the core the moment it arrives, ahead of
anything the busy loop is doing, and the core makes it land before the running step's outputs (rule 3
of ``engine/core_api.py``): the scheduler's core right after the forward, the mock's at once, before
the step's tokens are made. Either way an aborted request produces no output from the step that was
running when the abort arrived, nor after it.

A defensive rule on the input side (``RecentAborts``): an add that arrives after an abort of the same
request id is dropped. API servers never send one (their engine client drops a queued add instead of
sending its abort ahead of it); this keeps a request that somehow overtook its own abort from running
to ``max_tokens`` with nobody reading it.

A request the core refuses (``add`` returns an error output) is answered with the next outputs to its
API server, or at once when no step is due.

``ClientReset(i)`` (the first message of a restarted API server, docs/processes.md) aborts every request
the core holds for client index ``i``: they belonged to the process that died. Each input pump also
says Ready again whenever its socket's connection is made anew (engine/handshake.py). With a DP
coordinator, the busy loop sends it this engine's load (``engine/load_report.py``'s rule) and its prefix
cache's stored and evicted blocks (``engine/kv_events.py``) after each step and when idle, never waiting
on the socket.

Stats-only messages (``engine.output_pump.Heartbeat``): right after the step in which the last request
finished or was aborted, and every ``HEARTBEAT_INTERVAL`` to an API server that heard nothing
meanwhile; the idle loop waits for work at most until the next one is due. Between steps the busy loop
sends them; while a step runs (the busy loop awaits ``execute``) the beat task does, through the
pump's never-awaiting ``beat``, so a step of many seconds (a CPU model's 2048-token prefill chunk) is
no silence: an API server hears silence only from a stopped engine core.

Whether the running step is overdue is this process's own judgement (``engine.step_watch``: a bound
from the step's token count and the recent steps' durations). Every stats message sent while a step
runs carries it (``EngineStats.step_*``), and the beat task tells every API server at once when the
step becomes overdue; an API server then reports the engine stalled (``frontend/engine_health.py``).
A hung worker is thus refused fast, long before ``--worker-step-timeout`` fails it.

A core that fails (``ExecutorFailed``: a worker died, hung or raised), during a step or while the
engine is idle, ends the engine: every API server gets ``EngineDead`` with the reason (and fails the
requests it holds with it), then ``run`` raises and the process exits with an error. Nothing waits on
a dead worker. ``ShutdownEngine`` ends ``run`` after the current step.

Retirement (a resize retires this replica, docs/replicas.md): each client sends ``ClientDone`` after
the last add it placed here. Once every client it joined has, and the core holds no request (nor a
refusal still to send), the busy loop sends every client ``EngineRetired``, after anything the output
pump still holds, and ``run`` returns: the process exits 0. A ``ClientReset`` takes its index's word
back (the restarted API server gives its own).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NoReturn

import trio
import zmq

from trioserve.config import EngineConfig
from trioserve.engine.core_api import Core
from trioserve.engine.executor import ExecutorFailed
from trioserve.engine.handshake import join_frontends
from trioserve.engine.kv_events import flush_kv_events
from trioserve.engine.load_report import LoadReporter
from trioserve.engine.output_pump import OutputPump
from trioserve.engine.step_watch import StepWatch
from trioserve.protocol.codec import ProtocolError, engine_input_codec, load_report_codec
from trioserve.protocol.messages import (
    AbortRequests,
    AddRequest,
    ClientDone,
    ClientReset,
    EngineDead,
    EngineInput,
    EngineOutputs,
    EngineReady,
    EngineRetired,
    EngineStats,
    RequestOutput,
    ShutdownEngine,
)
from trioserve.runtime.sync import Waker
from trioserve.transport.zmq_socket import TrioZmqSocket, wait_any_readable

log = logging.getLogger("trioserve.engine")


class EngineCore:
    """The shell. ``config`` is the engine section (handshake address, engine index, output HWM and
    policy); ``step_timeout`` caps the step watch's bound (the executor's own hard limit on a step,
    when it has one). ``core`` is read at every step, so a test may swap it between steps."""

    def __init__(
        self,
        config: EngineConfig,
        core: Core,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        step_timeout: float | None = None,
    ) -> None:
        if config.handshake_address is None:
            raise ValueError("an engine core needs a handshake address")
        self.config = config
        self.handshake_address = config.handshake_address
        self.core = core
        self._ctx = ctx
        self._rejected: dict[int, list[RequestOutput]] = {}
        self._work = Waker()
        self._shutdown = False
        self._done: set[int] = set()  # clients that sent ClientDone: they send this engine no more adds
        self.step_count = 0
        self.pump: OutputPump | None = None
        self.step_watch = StepWatch(ceiling=step_timeout)
        self._step_started = Waker()
        self._told_overdue = -1  # the number of the last step the beat task reported overdue
        self._coordinator: TrioZmqSocket | None = None  # the DP coordinator's PULL, with data parallelism
        self._load_reporter = LoadReporter(config.engine_index)
        self._load_codec = load_report_codec()
        core.wake_on_failure(self._work.set)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join every API server, start the pumps and the beat task, then run the busy loop until a
        ``ShutdownEngine`` (returns) or a failure (raises ``ExecutorFailed``)."""
        cfg = self.config
        ready = self.core.ready(cfg.engine_index, os.getpid())
        sockets = await join_frontends(
            self._ctx, self.handshake_address, ready, output_hwm=cfg.engine_output_hwm
        )
        try:
            async with trio.open_nursery() as nursery:
                for sock, monitor in zip(sockets.inputs, sockets.monitors, strict=True):
                    nursery.start_soon(_input_pump, sock, self._on_input, monitor, sockets.ready_frame)
                self._coordinator = sockets.coordinator
                pump = self.pump = OutputPump(sockets.outputs, cfg.engine_output_policy)
                if pump.policy == "fold":
                    nursery.start_soon(pump.run)
                nursery.start_soon(self._beat_during_steps, pump)
                task_status.started()
                await self._busy_loop(pump, ready)
                nursery.cancel_scope.cancel()
        finally:
            sockets.close()

    def _on_input(self, msg: EngineInput) -> None:
        match msg:
            case AddRequest():
                rejected = self.core.add(msg)
                if rejected is not None:
                    self._rejected.setdefault(msg.client_index, []).append(rejected)
            case AbortRequests(request_ids=ids):
                self.core.abort(ids)  # the fast path: the core lands it before the step's outputs
            case ShutdownEngine():
                self._shutdown = True
            case ClientReset(client_index=client):
                # A new API server holds this index: what the old one owned has nobody to go to.
                orphans = self.core.client_requests(client)
                if orphans:
                    log.info("API server %d was restarted: dropping its %d requests", client, len(orphans))
                    self.core.abort(orphans)
                self._rejected.pop(client, None)
                self._done.discard(client)  # the new process says for itself whether it is done
            case ClientDone(client_index=client):
                self._done.add(client)
        self._work.set()

    async def _busy_loop(self, pump: OutputPump, ready: EngineReady) -> None:
        ledger = f"{ready.num_kv_blocks} KV blocks of {ready.block_size}" if ready.block_size else "no KV"
        log.info(
            "engine core %d ready (%s core: max_num_seqs %d, max_model_len %d, %s)",
            ready.engine_index,
            ready.kind,
            ready.max_num_seqs,
            ready.max_model_len,
            ledger,
        )
        watch = self.step_watch
        while not self._shutdown:
            core = self.core
            if core.failure is not None:
                await self._die(str(core.failure), pump)
            tokens = core.schedule()
            if tokens is None:
                if self._rejected:
                    await self._send({}, pump)
                    continue
                if len(self._done) >= pump.num_clients and not core.has_work:
                    # Retired (a resize): every client is done with this engine and nothing is left.
                    log.info("engine core %d retired: every client is done with it", ready.engine_index)
                    await pump.send_last(EngineRetired(ready.engine_index))
                    return
                await pump.send_stats(core.has_work, self._stats_message)  # idle report, heartbeats
                due = pump.heartbeat.next_due()
                if self._coordinator is not None:
                    self._report_load(core.stats())
                    due = min(due, self._load_reporter.next_due())
                await wait_for_work(self._work, due)  # nothing to compute until a request or an abort
                continue
            watch.start(tokens, trio.current_time())
            self._step_started.set()
            failure: ExecutorFailed | None = None
            try:
                await core.execute()
            except ExecutorFailed as exc:
                failure = exc
            finally:
                # Before anything else touches a socket: the beat task sends only while a step runs.
                ran = watch.end(trio.current_time())
            if failure is not None:
                await self._die(str(failure), pump)
            # A step reported overdue that returns is news for every API server, not only for those
            # its outputs go to: they would read the engine as stalled until their next heartbeat.
            recovered = ran is not None and ran.number == self._told_overdue
            await self._send(core.update(), pump, recovered)

    async def _die(self, reason: str, pump: OutputPump) -> NoReturn:
        """The model cannot run any more: tell every API server (each fails the requests it holds with
        ``reason``), then end this process with an error."""
        await pump.send_last(EngineDead(self.config.engine_index, reason))
        raise ExecutorFailed(reason)

    async def _send(
        self, per_client: dict[int, list[RequestOutput]], pump: OutputPump, recovered: bool = False
    ) -> None:
        for client, outs in self._rejected.items():
            per_client.setdefault(client, []).extend(outs)
        self._rejected = {}
        self.step_count += 1
        core = self.core
        stats = core.stats()
        now = time.time()
        index = self.config.engine_index
        for client, outs in per_client.items():
            await pump.send(client, EngineOutputs(index, self.step_count, now, outs, stats))
        others = [c for c in range(pump.num_clients) if c not in per_client] if recovered else []
        await pump.send_stats(core.has_work, self._stats_message, also=others)
        if self._coordinator is not None:
            self._report_load(stats)

    def _report_load(self, stats: EngineStats) -> None:
        """Tell the DP coordinator this engine's load when ``LoadReporter`` says so (never waits: a
        full socket skips a report, and a later one says the same and more)."""
        assert self._coordinator is not None
        report = self._load_reporter.check(
            trio.current_time(), stats.num_waiting, stats.num_running, stats.kv_usage
        )
        if report is not None:
            self._coordinator.try_send_multipart([self._load_codec.encode(report)])
        # What the prefix cache stored and evicted since (the ``prefix`` dispatch policy's hints).
        flush_kv_events(
            self.core, self.config.engine_index, trio.current_time(), self._coordinator.try_send_multipart
        )

    async def _beat_during_steps(self, pump: OutputPump) -> None:
        """The beat task: while a step runs, the heartbeats owed (``pump.beat``), and the moment the
        step becomes overdue, a stats message to every API server at once. It sleeps while no step
        runs (the busy loop sends between steps), and wakes at most once per heartbeat interval or
        overdue check, not per step."""
        watch = self.step_watch
        while True:
            step = watch.running
            if step is None:
                await self._step_started.wait()
                continue
            due = pump.heartbeat.next_due()
            if self._told_overdue != step.number:
                due = min(due, watch.overdue_at(trio.current_time()))
            await trio.sleep_until(due)
            if watch.running is not step:  # it ended meanwhile: look at the next one
                continue
            now = trio.current_time()
            news = self._told_overdue != step.number and watch.overdue_now(now)
            if news:
                self._told_overdue = step.number
                log.warning(
                    "engine core %d: a step of %d tokens has run %.1f s, past its bound of %.1f s",
                    self.config.engine_index,
                    step.tokens,
                    now - step.started,
                    watch.bound(step.tokens),
                )
            pump.beat(self._stats_message, everyone=news)

    def _stats_message(self) -> EngineOutputs:
        stats = self.core.stats()
        watch = self.step_watch
        step = watch.running
        if step is not None:  # a message sent mid-step says how the step stands
            now = trio.current_time()
            stats.step_tokens = step.tokens
            stats.step_elapsed = now - step.started
            stats.step_bound = watch.bound(step.tokens)
            stats.step_overdue = watch.overdue_now(now)
        return EngineOutputs(self.config.engine_index, self.step_count, time.time(), [], stats)


async def wait_for_work(work: Waker, due: float) -> None:
    """An idle busy loop's wait: until ``work`` is set or ``due`` (the next heartbeat, or load report),
    whichever comes first (the caller then sends what is owed and looks for work again)."""
    with trio.move_on_at(due):
        await work.wait()


class RecentAborts:
    """The last ``capacity`` request ids aborted through one API server's socket. Request ids are
    unique across the deployment, so an add for one of them arrived after its own abort and must not
    run. Bounded: a set for lookups and a FIFO that forgets the oldest id (an add overtaken by more
    than ``capacity`` aborts is not caught; the API server's ordering is the real guarantee)."""

    __slots__ = ("_ids", "_order", "capacity")

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: set[str] = set()
        self._order: deque[str] = deque()

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
        """Whether an add for ``request_id`` comes after its abort (the caller drops it)."""
        return request_id in self._ids


async def _input_pump(
    sock: TrioZmqSocket,
    on_input: Callable[[EngineInput], None],
    monitor: TrioZmqSocket | None = None,
    ready_frame: bytes = b"",
) -> None:
    """One per API server: decode each frame and hand it over; a bad frame is logged and dropped, and
    so is an add whose abort came first (``RecentAborts``). It owns the socket's ``monitor`` too: each
    connection handshake it reports (a restarted API server, engine/handshake.py) is answered with
    ``ready_frame`` on the socket."""
    codec = engine_input_codec()
    aborts = RecentAborts()
    while True:
        frames = sock.try_recv_multipart()
        if frames is None:
            if monitor is None:
                frames = await sock.recv_multipart()
            elif monitor.try_recv_multipart() is not None:
                sock.try_send_multipart([ready_frame])
                continue
            else:
                await wait_any_readable(sock, monitor)
                continue
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
