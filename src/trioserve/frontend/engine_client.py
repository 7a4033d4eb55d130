"""The API server's side of the engine link: handshake, requests out, outputs in.

Sockets (design §5): the API server binds a ROUTER for requests (each engine's DEALER identity is its
engine index) and a PULL for outputs; engines join through a handshake ROUTER. Each socket has exactly
one owner task. Other tasks hand work to the sender through two queues; ``abort`` goes ahead of queued
``add``s, so a stop-string match or a disconnect reaches the engine without waiting behind new requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable

import trio
import zmq

from trioserve.engine.handshake import engine_identity
from trioserve.frontend.step_queue import StepQueue
from trioserve.protocol.codec import ProtocolError, engine_input_codec, engine_output_codec, handshake_codec
from trioserve.protocol.messages import (
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
)
from trioserve.sync import Waker
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
        self._adds: deque[bytes] = deque()
        self._aborts: list[str] = []
        self._wake = Waker()
        self._in_codec = engine_input_codec()
        self._out_codec = engine_output_codec()

    @property
    def queued_adds(self) -> int:
        return len(self._adds)

    # ---- called from any task; never blocks -------------------------------------------------------

    def add(self, request: AddRequest) -> None:
        self._adds.append(self._in_codec.encode(request))
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._aborts += request_ids
            self._wake.set()

    # ---- the owner tasks -----------------------------------------------------------------------------

    async def run(
        self,
        outputs: StepQueue,
        on_dead: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, wait for every engine's handshake, then pump until cancelled."""
        router = TrioZmqSocket.create(self._ctx, zmq.ROUTER, bind=self.input_address)
        # Unroutable or full: raise instead of silently dropping (ROUTER's default).
        router.raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        pull = TrioZmqSocket.create(self._ctx, zmq.PULL, bind=self.output_address, rcvhwm=self.output_hwm)
        try:
            await self._handshake(router)
            task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_loop, router, on_dead)
                nursery.start_soon(self._recv_loop, pull, outputs, on_dead)
        finally:
            goodbye = self._in_codec.encode(ShutdownEngine("api server exit"))
            for index in self.engines:
                with contextlib.suppress(zmq.ZMQError):  # the engine may be gone already
                    router.try_send_multipart([engine_identity(index), goodbye])
            router.close()
            pull.close()

    async def _handshake(self, router: TrioZmqSocket) -> None:
        codec = handshake_codec()
        hs = TrioZmqSocket.create(self._ctx, zmq.ROUTER, bind=self.handshake_address)
        welcome = codec.encode(Welcome([ClientAddresses(self.input_address, self.output_address)]))
        try:
            hellos = 0
            while hellos < self.num_engines:
                peer, frame = (await hs.recv_multipart())[-2:]
                try:
                    hello = codec.decode(frame)
                except ProtocolError as exc:
                    log.warning("handshake: %s", exc)
                    continue
                if not isinstance(hello, EngineHello) or hello.protocol_version != PROTOCOL_VERSION:
                    log.warning("handshake: unexpected %r", hello)
                    continue
                await hs.send_multipart([peer, welcome])
                hellos += 1
        finally:
            hs.close()
        while len(self.engines) < self.num_engines:
            frame = (await router.recv_multipart())[-1]
            try:
                ready = codec.decode(frame)
            except ProtocolError as exc:
                log.warning("handshake: %s", exc)
                continue
            if isinstance(ready, EngineReady):
                self.engines[ready.engine_index] = ready
                log.info("engine %d ready (%s, pid %d)", ready.engine_index, ready.kind, ready.pid)

    async def _send_loop(self, router: TrioZmqSocket, on_dead: Callable[[str], None]) -> None:
        identity = engine_identity(0)  # one engine per API server until data parallelism lands
        while True:
            if self._aborts:
                frame = self._in_codec.encode(AbortRequests(self._aborts))
                self._aborts = []
            elif self._adds:
                frame = self._adds.popleft()
            else:
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
            match msg:
                case EngineOutputs():
                    await outputs.put(msg)
                case EngineDead(engine_index=index, reason=reason):
                    on_dead(f"engine {index} failed: {reason}")
