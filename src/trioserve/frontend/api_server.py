"""One API server: its tasks, all in one nursery (design §3).

accept loop + fast path (``HttpServer``) · ASGI host (hypercorn + quart-trio, lifespan) · engine client
(handshake, request sender with the abort fast path, output pump) · output handler. The renderer pool
is ``trio.to_thread`` under a ``CapacityLimiter`` owned by ``Serving``.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import trio
import zmq

from trioserve.config import ServeConfig
from trioserve.frontend.app import create_app
from trioserve.frontend.asgi_host import AsgiHost
from trioserve.frontend.engine_client import EngineClient
from trioserve.frontend.http_server import HttpServer
from trioserve.frontend.output_handler import OutputHandler
from trioserve.frontend.serving import Serving
from trioserve.frontend.step_queue import StepQueue
from trioserve.frontend.tokenizer import Tokenizer

log = logging.getLogger("trioserve.frontend")


@dataclass(frozen=True, slots=True)
class EngineAddresses:
    handshake: str
    input: str
    output: str


LOOP_LAG_INTERVAL = 0.05  # seconds between loop-lag samples


class ApiServer:
    def __init__(
        self,
        config: ServeConfig,
        tokenizer: Tokenizer,
        ctx: zmq.Context[zmq.Socket[bytes]],
        addresses: EngineAddresses,
    ) -> None:
        self.config = config
        self.engine = EngineClient(
            ctx,
            handshake_address=addresses.handshake,
            input_address=addresses.input,
            output_address=addresses.output,
            output_hwm=config.engine_output_hwm,
        )
        self.steps = StepQueue(config.output_queue_size, config.output_queue_policy)
        self.handler = OutputHandler(self.engine.abort)
        self.serving = Serving(config, tokenizer, self.engine, self.handler)
        self.asgi = AsgiHost(create_app(self.serving), max_body=config.max_request_body_bytes)
        self.http = HttpServer(self.serving, self.asgi.handoff, config.max_request_body_bytes)

    async def run(
        self,
        listener: socket.socket | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start every task; ``started`` once engines are ready and the listener (if any) accepts."""
        async with trio.open_nursery() as nursery:
            with trio.fail_after(self.config.engine_ready_timeout):
                await nursery.start(self.engine.run, self.steps, self.serving.on_engine_dead)
            nursery.start_soon(self.handler.run, self.steps)
            nursery.start_soon(self._watch_loop_lag)
            await nursery.start(self.asgi.run)
            if listener is not None:
                await nursery.start(self.http.serve, listener)
            task_status.started()

    async def _watch_loop_lag(self) -> None:
        """How late a short sleep wakes up is how far behind the event loop is: every task (and
        every stream) on this loop waits that long. Admission sheds new requests above the limit."""
        admission = self.serving.admission
        while True:
            due = trio.current_time() + LOOP_LAG_INTERVAL
            await trio.sleep_until(due)
            admission.loop_lag = max(0.0, trio.current_time() - due)
