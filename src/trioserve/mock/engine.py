"""The mock engine core's Trio shell: input pumps, a busy loop on a fixed step clock, outputs.

Timing model (what a GPU would do, minus the GPU): a step starts as soon as there is work and lasts
``step_interval_us``; its tokens are produced at the end of the step. Back-to-back steps follow the
clock exactly; a step that starts late (the loop was busy) starts at once and later steps are spaced
from there (tokio's ``MissedTickBehavior::Delay``, as in seed 000's patch). Aborts that arrive during a
step are applied before that step's tokens are made, so a stop-string abort costs at most one step.

Stats-only messages (``engine.output_pump.Heartbeat``): right after the step in which the last request
finished or was aborted, and every ``HEARTBEAT_INTERVAL`` to an API server that heard nothing
meanwhile (while idle: to every API server, from the idle wait).
"""

from __future__ import annotations

import logging
import os
import time

import trio
import trio.lowlevel
import zmq

from trioserve.config import MockEngineConfig
from trioserve.engine.output_pump import OutputPump
from trioserve.engine.shell import run_engine, wait_for_work
from trioserve.mock.core import MockCore
from trioserve.protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineInput,
    EngineOutputs,
    EngineReady,
    RequestOutput,
    ShutdownEngine,
)
from trioserve.sync import Waker

log = logging.getLogger("trioserve.mock")


class MockEngine:
    def __init__(self, config: MockEngineConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.config = config
        self._ctx = ctx
        self.core = MockCore(
            vocab_size=config.vocab_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            seed=config.seed,
        )
        self.step_count = 0
        self._rejected: dict[int, list[RequestOutput]] = {}  # client -> error outputs for next send
        self.pump: OutputPump | None = None
        self._work = Waker()
        self._shutdown = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        ready = EngineReady(
            engine_index=cfg.engine_index,
            pid=os.getpid(),
            kind="mock",
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            vocab_size=cfg.vocab_size,
        )
        await run_engine(
            self._ctx,
            cfg.handshake_address,
            ready,
            output_hwm=cfg.output_hwm,
            output_policy=cfg.output_policy,
            on_input=self._on_input,
            busy_loop=self._busy_loop,
            task_status=task_status,
        )

    def _on_input(self, msg: EngineInput) -> None:
        match msg:
            case AddRequest():
                rejected = self.core.add(msg)
                if rejected is not None:
                    self._rejected.setdefault(msg.client_index, []).append(rejected)
            case AbortRequests(request_ids=ids):
                self.core.abort(ids)  # before the current step's tokens are made
            case ShutdownEngine():
                self._shutdown = True
        self._work.set()

    async def _busy_loop(self, pump: OutputPump) -> None:
        self.pump = pump
        cfg = self.config
        log.info("mock engine %d ready (step %d us)", cfg.engine_index, cfg.step_interval_us)
        interval = self.config.step_interval_us / 1e6
        next_start = trio.current_time()
        while not self._shutdown:
            if not self.core.has_work and not self._rejected:
                await pump.send_stats(False, self._stats_message)  # the idle report, heartbeats
                await wait_for_work(self._work, pump)
                next_start = trio.current_time()  # a step starts as soon as work arrives
                continue
            now = trio.current_time()
            # Keep the schedule (no drift from our own work); restart it only after idling or when a
            # whole step late (tokio's MissedTickBehavior::Delay).
            start = next_start if now - next_start < interval else now
            if interval > 0:
                next_start = start + interval
                await trio.sleep_until(next_start)
            else:
                await trio.lowlevel.checkpoint()  # let the input pumps run between steps
            per_client = self.core.step()
            for client, outs in self._rejected.items():
                per_client.setdefault(client, []).extend(outs)
            self._rejected = {}
            self.step_count += 1
            stats = self.core.stats()
            now = time.time()
            for client, outs in per_client.items():
                await pump.send(
                    client, EngineOutputs(self.config.engine_index, self.step_count, now, outs, stats)
                )
            await pump.send_stats(self.core.has_work, self._stats_message)

    def _stats_message(self) -> EngineOutputs:
        return EngineOutputs(self.config.engine_index, self.step_count, time.time(), [], self.core.stats())
