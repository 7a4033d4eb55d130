"""The engine-core process's Trio shell around the pure scheduler (design §3, §7).

Tasks, all in one nursery: an input pump per API server (decodes requests, builds ``Request``s and
hashes their prompt blocks between steps, so the step itself never does), the busy loop
(``schedule`` → ``executor.execute`` → ``update_from_output``) with its beat task beside it, and the
output pump.

Aborts take a fast path: the input pump only queues them, and the busy loop applies them right after
the current forward, before that step's outputs are processed, so an aborted request produces no
output after the step that was running when the abort arrived.

Stats-only messages (``engine.output_pump.Heartbeat``): right after the step in which the last request
finished or was aborted, and every ``HEARTBEAT_INTERVAL`` to an API server that heard nothing
meanwhile; the idle loop waits for work at most until the next one is due. Between steps the busy loop
sends them; while a step runs (the busy loop awaits the executor) the beat task does, through the
pump's never-awaiting ``beat``, so a step of many seconds (a CPU model's 2048-token prefill chunk) is
no silence: an API server hears silence only from a stopped engine core.

Whether the running step is overdue is this process's own judgement (``engine.step_watch``: a bound
from the step's token count and the recent steps' durations). Every stats message sent while a step
runs carries it (``EngineStats.step_*``), and the beat task tells every API server at once when the
step becomes overdue; an API server then reports the engine stalled (``frontend/engine_health.py``).
A hung worker is thus refused fast, long before ``--worker-step-timeout`` fails it.

An executor that fails (``ExecutorFailed``: a worker died, hung or raised), during a step or while the
engine is idle, ends the engine: every API server gets ``EngineDead`` with the reason (and fails the
requests it holds with it), then the process exits with an error. Nothing waits on a dead worker.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import NoReturn

import trio
import zmq

from trioserve.engine.executor import Executor, ExecutorFailed
from trioserve.engine.output_pump import OutputPolicy, OutputPump
from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.engine.shell import run_engine, wait_for_work
from trioserve.engine.step_watch import StepWatch
from trioserve.protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineInput,
    EngineOutputs,
    EngineReady,
    RequestOutput,
    ShutdownEngine,
)
from trioserve.sync import Waker

log = logging.getLogger("trioserve.engine")


@dataclass(frozen=True, slots=True)
class EngineCoreConfig:
    handshake_address: str
    scheduler: SchedulerConfig
    vocab_size: int
    kind: str = "reference"  # what executes the steps, as reported in the handshake
    engine_index: int = 0
    output_hwm: int = 64
    output_policy: OutputPolicy = "fold"
    step_timeout: float | None = None  # the executor's hard limit on one step (the worker's), if any


class EngineCore:
    def __init__(
        self, config: EngineCoreConfig, executor: Executor, ctx: zmq.Context[zmq.Socket[bytes]]
    ) -> None:
        self.config = config
        self.executor = executor
        self.scheduler = Scheduler(config.scheduler)
        self._ctx = ctx
        self._aborts: list[str] = []
        self._rejected: dict[int, list[RequestOutput]] = {}
        self._work = Waker()
        self._shutdown = False
        self.step_count = 0
        self.pump: OutputPump | None = None
        self.step_watch = StepWatch(ceiling=config.step_timeout)
        self._step_started = Waker()
        self._told_overdue = -1  # the number of the last step the beat task reported overdue
        executor.on_failure = self._work.set

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        sched = cfg.scheduler
        ready = EngineReady(
            engine_index=cfg.engine_index,
            pid=os.getpid(),
            kind=cfg.kind,
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            vocab_size=cfg.vocab_size,
            num_kv_blocks=sched.num_blocks,
            block_size=sched.block_size,
        )
        await run_engine(
            self._ctx,
            cfg.handshake_address,
            ready,
            output_hwm=cfg.output_hwm,
            output_policy=cfg.output_policy,
            on_input=self._on_input,
            busy_loop=self._busy_loop,
            beside=self._beat_during_steps,
            task_status=task_status,
        )

    def _on_input(self, msg: EngineInput) -> None:
        match msg:
            case AddRequest():
                rejected = self.scheduler.add_request(msg, time.time())
                if rejected is not None:
                    self._rejected.setdefault(msg.client_index, []).append(rejected)
            case AbortRequests(request_ids=ids):
                self._aborts += ids  # applied by the busy loop right after the current forward
            case ShutdownEngine():
                self._shutdown = True
        self._work.set()

    def _apply_aborts(self) -> None:
        if self._aborts:
            self.scheduler.abort(self._aborts)
            self._aborts = []

    async def _busy_loop(self, pump: OutputPump) -> None:
        self.pump = pump
        log.info("engine core %d ready (%s executor)", self.config.engine_index, self.config.kind)
        scheduler = self.scheduler
        watch = self.step_watch
        while not self._shutdown:
            if self.executor.failure is not None:
                await self._die(str(self.executor.failure), pump)
            self._apply_aborts()
            step = scheduler.schedule(time.time()) if scheduler.has_work else None
            if step is None or step.is_empty:
                if self._rejected:
                    await self._send({}, pump)
                    continue
                await pump.send_stats(scheduler.has_work, self._stats_message)  # idle report, heartbeats
                await wait_for_work(self._work, pump)  # nothing to compute until a request or an abort
                continue
            watch.start(step.total_num_scheduled_tokens, trio.current_time())
            self._step_started.set()
            failure: ExecutorFailed | None = None
            try:
                sampled = await self.executor.execute(step)
            except ExecutorFailed as exc:
                failure = exc
            finally:
                # Before anything else touches a socket: the beat task sends only while a step runs.
                ran = watch.end(trio.current_time())
            if failure is not None:
                await self._die(str(failure), pump)
            self._apply_aborts()  # the fast path: before this step's outputs are processed
            # A step reported overdue that returns is news for every API server, not only for those
            # its outputs go to: they would read the engine as stalled until their next heartbeat.
            recovered = ran is not None and ran.number == self._told_overdue
            await self._send(scheduler.update_from_output(step, sampled, time.time()), pump, recovered)

    async def _die(self, reason: str, pump: OutputPump) -> NoReturn:
        """The model cannot run any more: tell every API server (each fails the requests it holds with
        ``reason``), then end this process with an error."""
        await pump.send_dead(EngineDead(self.config.engine_index, reason))
        raise ExecutorFailed(reason)

    async def _send(
        self, per_client: dict[int, list[RequestOutput]], pump: OutputPump, recovered: bool = False
    ) -> None:
        for client, outs in self._rejected.items():
            per_client.setdefault(client, []).extend(outs)
        self._rejected = {}
        self.step_count += 1
        stats = self.scheduler.stats()
        now = time.time()
        for client, outs in per_client.items():
            await pump.send(
                client, EngineOutputs(self.config.engine_index, self.step_count, now, outs, stats)
            )
        others = [c for c in range(pump.num_clients) if c not in per_client] if recovered else []
        await pump.send_stats(self.scheduler.has_work, self._stats_message, also=others)

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
        stats = self.scheduler.stats()
        watch = self.step_watch
        step = watch.running
        if step is not None:  # a message sent mid-step says how the step stands
            now = trio.current_time()
            stats.step_tokens = step.tokens
            stats.step_elapsed = now - step.started
            stats.step_bound = watch.bound(step.tokens)
            stats.step_overdue = watch.overdue_now(now)
        return EngineOutputs(self.config.engine_index, self.step_count, time.time(), [], stats)
